"""Errors that reach the user as one line instead of a traceback."""


class ConfigError(Exception):
    """A user error in the job configuration; reported as one line, exit code 2."""


class TorchCompatError(Exception):
    """The installed PyTorch lacks (or changed) a private API graph_trainer uses; reported as one
    line naming the API and the torch version, exit code 2 (see ``graph_trainer.torch_compat``)."""
