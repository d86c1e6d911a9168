"""``weights.fanout``: who sends the weights, and the configs it refuses, naming the key."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.weights.senders import fanout_senders


@pytest.mark.parametrize(("sets", "world", "senders"), [
    ([], 1, 1),                                            # one rank sends anyway
    ([], 4, 4),                                            # auto: every rank
    (["weights.fanout=false"], 4, 1),
    (["weights.fanout=true"], 1, 1),
    (["learner.backend=deepspeed"], 4, 4),                 # ZeRO gathers on every rank too
    (["learner.backend=deepspeed", "weights.fanout=true"], 2, 2),
    (["model.lora.rank=8"], 4, 1),                         # torch engines get adapters alone
    (["model.lora.rank=8", "rollout.engine=vllm"], 4, 4),  # vLLM gets merged weights
])
def test_auto_fans_out_with_several_ranks_where_the_full_weights_travel(sets, world, senders):
    assert fanout_senders(load_config(None, sets), world) == senders


def test_fanout_true_where_it_cannot_run_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["weights.fanout=true", "model.lora.rank=8"])
    assert "weights.fanout = true" in str(error.value)
    assert "LoRA adapters alone" in str(error.value)


def test_a_value_other_than_true_false_or_auto_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["weights.fanout=yes"])
    assert str(error.value).splitlines()[1:] == [
        "  weights.fanout: must be true, false or \"auto\" (got 'yes')"]
