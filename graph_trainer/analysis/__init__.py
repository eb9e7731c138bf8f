"""Reading traced graphs: collectives, and (later) simulated time and memory."""
