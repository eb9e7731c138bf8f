"""Parallelism as modules and DTensor redistributions: degrees and mesh, SimpleFSDP, expert parallel,
chunking, collective timeouts."""
