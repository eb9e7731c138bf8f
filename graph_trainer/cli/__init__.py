"""The commands: ``python -m graph_trainer.cli.<name>`` (docs/architecture.md, "Commands")."""
