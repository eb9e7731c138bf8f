"""graph_trainer.torch_compat.versions: which torch this is, and private_api's one-line error.

Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import pytest
import torch


def test_private_api_turns_a_missing_api_into_one_line_naming_it_and_the_version():
    from graph_trainer.errors import TorchCompatError
    from graph_trainer.torch_compat import SUPPORTED_TORCH, private_api

    with pytest.raises(TorchCompatError) as info:
        with private_api("torch._no_such_thing"):
            torch._no_such_thing  # noqa: B018
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        f"PyTorch private API torch._no_such_thing is not available in torch {torch.__version__} ("
    )
    assert message.endswith(f"graph_trainer supports torch {SUPPORTED_TORCH}")
    with pytest.raises(ZeroDivisionError):  # other errors pass through untouched
        with private_api("x"):
            1 / 0  # noqa: B018
