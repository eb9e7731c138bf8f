"""Model families the graph trainer can build (see ``models.registry``)."""
