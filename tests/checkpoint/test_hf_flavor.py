"""Any LLaMA-3-, DeepSeek-V3- or Qwen3-shaped Hugging Face folder, not only our flavors' shapes
(``--model.flavor hf``: the model ``config.json`` describes): a GQA model with 4 of 16 kv heads,
vocabulary 1000 and its own feed-forward size, and a tied-embedding model shaped like LLaMA 3.2
(RoPE scaling factor 32), against ``transformers``' logits (the bound of tests/checkpoint/test_hf.py)
on one process, FSDP=2 and TP=2; trained from; exported and reloaded bitwise (tied: one tensor,
no ``lm_head``); Qwen3 and Qwen3-MoE folders of other shapes (a head size of their own, 4 experts
with unnormalised top-2 weights) on one process; every flavor of every family written as
``config.json`` and read back; and what such a config cannot be, one line each."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.validation import validate_config
from models.deepseek_v3.hf import args_from_config as deepseek_args
from models.llama3.flavors import LLAMA3_1_SCALING, RopeScaling
from models.llama3.hf import args_from_config as llama_args
from models.registry import model_args
from tests.conftest import ROOT
from tests.hf_models import deepseek_model, file_tensors, logits, relative_error, save
from tests.launch import read_losses, run_forked

BOUND = 3e-6
"""As tests/checkpoint/test_hf.py's (largest logit difference / largest logit, fp32)."""
HF_JOB = ["--job.config_file", os.path.join(ROOT, "configs/llama3_debug.toml"), "--model.flavor", "hf"]
COMMON = ["--job.device", "cpu", "--compile.mode", "eager", "--metrics.enable_tensorboard", "False"]
VOCAB = 1000


def _llama(tied: bool):
    """GQA (4 of 16 kv heads), LLaMA 3.1's RoPE scaling; or (``tied``) LLaMA 3.2's shape: tied
    embeddings, 2 of 8 kv heads, RoPE scaling factor 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    heads, kv_heads, factor = (8, 2, 32.0) if tied else (16, 4, 8.0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512 if tied else 384,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling={**scaling, "factor": factor, "original_max_position_embeddings": 8192},
        tie_word_embeddings=tied,
    )
    torch.manual_seed(7)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (transformers model, its folder, tokens, transformers' logits)."""
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, tied in (("gqa", False), ("tied", True)):
        model = _llama(tied)
        folder = save(model, tmp_path_factory.mktemp(name) / "hf", max_shard_size="1MB")
        out[name] = (model, folder, tokens, logits(model, tokens))
    return out


def _job(folder: Path, dump: Path, *extra: str) -> list[str]:
    return [*HF_JOB, *COMMON, "--checkpoint.initial_load_hf", str(folder), "--job.dump_folder", str(dump), *extra]


def test_the_model_is_the_one_config_json_describes(folders):
    gqa = model_args(load_config(_job(folders["gqa"][1], Path("unused"))))
    assert (gqa.dim, gqa.n_heads, gqa.kv_heads, gqa.vocab_size, gqa.ffn_hidden_dim) == (256, 16, 4, VOCAB, 384)
    assert gqa.rope_scaling == LLAMA3_1_SCALING and not gqa.tie_embeddings
    tied = model_args(load_config(_job(folders["tied"][1], Path("unused"), "--model.n_layers", "1")))
    assert tied.tie_embeddings and tied.rope_scaling == RopeScaling(factor=32.0) and tied.n_layers == 1
    assert tied.head_dim == 32 and tied.max_seq_len == 4096


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_one_process_computes_transformers_logits(tmp_path, folders, name):
    from tests.hf_probe import probe

    _, folder, tokens, reference = folders[name]
    cfg = load_config(_job(folder, tmp_path / "job"))
    validate_config(cfg)
    ours, nbytes, local, _ = probe(cfg, tokens)
    error = relative_error(ours, reference)
    print(f"{name} one process: largest logit difference / largest logit = {error:.2e}")
    assert error < BOUND
    assert nbytes == 4 * local  # every tensor read once: the tied one too


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_tied_embeddings_on_two_ranks_compute_transformers_logits(tmp_path, folders, layout):
    _, folder, tokens, reference = folders["tied"]
    torch.save(tokens, tmp_path / "tokens.pt")
    out = tmp_path / "probe"
    out.mkdir()
    degrees = ["--parallelism.dp_shard", "2"] if layout == "fsdp2" else ["--parallelism.dp_shard", "1"]
    degrees += [] if layout == "fsdp2" else ["--parallelism.tp", "2"]
    argv = _job(folder, tmp_path / "job", *degrees)
    run_forked(2, os.path.join(ROOT, "tests", "hf_probe.py"), str(out), str(tmp_path / "tokens.pt"), *argv)
    error = relative_error(torch.load(out / "logits.pt"), reference)
    print(f"tied {layout}: largest logit difference / largest logit = {error:.2e}")
    assert error < BOUND


def test_trained_from_and_exported_tied(tmp_path, folders):
    """A tied folder fine-tuned for 3 steps (graph mode, FSDP=2): losses fall, bitwise the same with
    each block's collectives bucketed (the output's gather of the embedding in the last bucket); the
    export holds one embedding tensor, no ``lm_head``, and ``transformers`` reloads it tied."""
    from transformers import AutoModelForCausalLM

    from graph_trainer.cli import export_hf

    _, folder, tokens, _ = folders["tied"]
    run = ["--compile.mode", "graph", "--parallelism.dp_shard", "2", "--training.steps", "3"]
    run += ["--training.seq_len", "32", "--training.local_batch_size", "2", "--checkpoint.interval", "3"]
    dump, bucketed = tmp_path / "job", tmp_path / "bucketed"
    run_forked(2, os.path.join(ROOT, "train.py"), *_job(folder, dump, *run))
    tbb = ["--compile.passes", "transformer_block_bucketing", "--checkpoint.interval", "0"]
    run_forked(2, os.path.join(ROOT, "train.py"), *_job(folder, bucketed, *run, *tbb))
    losses = read_losses(dump)
    assert len(losses) == 3 and losses[-1][1] < losses[0][1], losses
    assert read_losses(bucketed) == losses
    out = tmp_path / "exported"
    assert export_hf.main(["--checkpoint", str(dump / "checkpoint"), "--step", "3", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    trained = logits(reloaded.eval(), tokens)
    assert trained.isfinite().all() and not torch.equal(trained, folders["tied"][3])


def _config(tied: bool = False) -> dict:
    return _llama(tied).config.to_dict()


def test_what_a_llama_config_cannot_be_is_one_line_each():
    assert llama_args(_config()).ffn_hidden_dim == 384
    config = _config()
    del config["intermediate_size"]
    with pytest.raises(ConfigError, match="config.json lacks intermediate_size: a LLaMA-3 model cannot be built"):
        llama_args(config)
    with pytest.raises(ConfigError, match="cannot represent: head_dim 48"):
        llama_args(dict(_config(), head_dim=48))
    with pytest.raises(ConfigError, match="cannot represent: mlp_bias True"):
        llama_args(dict(_config(), mlp_bias=True))
    with pytest.raises(ConfigError, match="does not describe a LLaMA-3 model: n_heads .16. must be a multiple"):
        llama_args(dict(_config(), num_key_value_heads=5))


def test_a_deepseek_folder_of_other_shapes_computes_transformers_logits(tmp_path):
    """DeepSeek-V3 with 4 routed experts of which 2 are chosen, one group: no flavor of ours."""
    from transformers import DeepseekV3ForCausalLM

    from tests.hf_probe import probe

    config = deepseek_model().config
    config.update({"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1})
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(config).eval()
    folder = save(model, tmp_path / "hf")
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    job = ["--job.config_file", os.path.join(ROOT, "configs/deepseek_v3_debug.toml"), "--model.flavor", "hf"]
    cfg = load_config([*job, *COMMON, "--checkpoint.initial_load_hf", str(folder), "--job.dump_folder", str(tmp_path)])
    validate_config(cfg)
    assert model_args(cfg).n_routed_experts == 4
    error = relative_error(probe(cfg, tokens)[0], logits(model, tokens))
    print(f"deepseek (4 experts, 2 chosen) one process: largest logit difference / largest logit = {error:.2e}")
    assert error < BOUND


def test_deepseek_config_builds_its_model_and_refuses_a_tied_one():
    config = deepseek_model().config.to_dict()
    args = deepseek_args(config)
    assert (args.n_routed_experts, args.n_activated_experts, args.q_lora_rank, args.rope_factor) == (8, 3, 128, 40.0)
    assert args.score_func == "sigmoid" and args.n_dense_layers == 1
    smaller = deepseek_args(dict(config, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1))
    assert (
        dataclasses.replace(args, n_routed_experts=4, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1)
        == smaller
    )
    with pytest.raises(ConfigError, match="cannot represent: tie_word_embeddings True"):
        deepseek_args(dict(config, tie_word_embeddings=True))


def test_refusals_of_the_job():
    with pytest.raises(ConfigError, match="set checkpoint.initial_load_hf to that folder"):
        validate_config(load_config(["--model.flavor", "hf"]))


def test_tied_embeddings_refuse_float8_output(folders):
    argv = _job(folders["tied"][1], Path("unused"), "--float8.recipe_name", "tensorwise", "--float8.convert_output")
    with pytest.raises(ConfigError, match="computes with its embedding's weight .tied., which is no linear"):
        validate_config(load_config(argv))


def test_tied_embeddings_refuse_pipeline_stages(folders):
    argv = _job(folders["tied"][1], Path("unused"), "--parallelism.pp", "2", "--parallelism.pp_microbatches", "2")
    with pytest.raises(ConfigError, match="tied to its embedding, and pipeline stages would hold the two apart"):
        validate_config(load_config([*argv, "--parallelism.dp_shard", "1"]), world_size=2)


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "qwen3", "qwen3_moe"])
def test_every_flavor_written_as_config_json_comes_back_as_itself(family):
    """``args_from_config`` inverts ``hf_config`` for each of our flavors Hugging Face can hold
    (DeepSeek-V3's sigmoid-routed ones; every Qwen3 one): the same model, field for field (LLaMA's
    feed-forward size comes back given explicitly, where a flavor may compute it from its multiplier)."""
    from models.registry import MODEL_SPECS

    spec = MODEL_SPECS[family]
    checked = 0
    for name, args in spec.flavors.items():
        if family == "deepseek_v3" and args.score_func != "sigmoid":
            continue
        back = spec.hf.args_from_config(spec.hf.config(args, "bfloat16"))
        if family == "llama3":
            assert back.ffn_hidden == args.ffn_hidden_dim, name
            back = dataclasses.replace(
                back,
                ffn_hidden=args.ffn_hidden,
                multiple_of=args.multiple_of,
                ffn_dim_multiplier=args.ffn_dim_multiplier,
            )
        checked += 1
        assert back == args, name
    assert checked >= 2


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_load_export_round_trip_is_bitwise(tmp_path, folders, name):
    """Folder -> step-0 checkpoint -> export: every tensor of the folder bitwise, no other (a tied
    folder has no ``lm_head``, nor has its export); the export's config describes the same model."""
    from graph_trainer.cli import export_hf
    from graph_trainer.trainer import Trainer
    from models.llama3.hf import args_from_config

    _, folder, _, _ = folders[name]
    cfg = load_config(_job(folder, tmp_path / "job", "--training.steps", "0", "--checkpoint.interval", "1"))
    validate_config(cfg)
    assert Trainer(cfg).train() == []
    out = tmp_path / "exported"
    assert export_hf.main(["--checkpoint", str(tmp_path / "job" / "checkpoint"), "--step", "0", "--out", str(out)]) == 0

    original, exported = file_tensors(folder), file_tensors(out)
    assert sorted(original) == sorted(exported) and ("lm_head.weight" in original) == (name == "gqa")
    assert all(torch.equal(original[k], exported[k]) for k in original)
    config = json.loads((out / "config.json").read_text())
    assert args_from_config(config) == args_from_config(json.loads((folder / "config.json").read_text()))


# --------------------------------------------------------------------------------------
# Qwen3 and Qwen3-MoE


def _qwen3(moe: bool):
    """Qwen3 of no flavor's shape: 6 heads of 48 (288 features) over a 192-wide stream, 2 kv heads,
    vocabulary 1000, RoPE base 1e4, untied; ``moe``: every block 4 experts of width 96, top-2 with
    the weights left unnormalised. Random weights, the QK norms' too."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=192,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=48,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=False)
    torch.manual_seed(5)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **experts)) if moe else Qwen3ForCausalLM(Qwen3Config(**shape))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def _qwen3_job(moe: bool, folder: Path, dump: Path, flavor: str = "hf") -> list[str]:
    config = os.path.join(ROOT, "configs", "qwen3_moe_debug.toml" if moe else "qwen3_debug.toml")
    job = ["--job.config_file", config, "--model.flavor", flavor, *COMMON, "--checkpoint.initial_load_hf", str(folder)]
    return [*job, "--job.dump_folder", str(dump)]


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_a_qwen3_folder_of_other_shapes_computes_transformers_logits(tmp_path, moe):
    from tests.hf_probe import probe

    model = _qwen3(moe)
    folder = save(model, tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    cfg = load_config(_qwen3_job(moe, folder, tmp_path / "job"))
    validate_config(cfg)
    args = model_args(cfg)
    assert (args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.vocab_size) == (192, 6, 2, 48, VOCAB)
    assert args.rope_theta == 10000.0 and not args.tie_embeddings and args.max_seq_len == 4096
    if moe:
        assert (args.n_routed_experts, args.n_activated_experts, args.moe_inter_dim, args.route_norm) == (
            4,
            2,
            96,
            False,
        )
    else:
        assert args.ffn_hidden == 320 and not args.is_moe
    ours, nbytes, local, _ = probe(cfg, tokens)
    error = relative_error(ours, logits(model, tokens))
    print(f"{cfg.model.name} of other shapes, one process: largest logit difference / largest logit = {error:.2e}")
    assert error < BOUND
    assert nbytes == 4 * local


def test_what_a_qwen3_config_cannot_be_is_one_line_each():
    from models.registry import MODEL_SPECS

    dense, moe = MODEL_SPECS["qwen3"].hf, MODEL_SPECS["qwen3_moe"].hf
    dense_config, moe_config = _qwen3(False).config.to_dict(), _qwen3(True).config.to_dict()
    assert dense.args_from_config(dense_config).head_dim == 48 and moe.args_from_config(moe_config).is_moe
    # the expert count under the published files' name, or the one transformers 5 writes
    published = {k: v for k, v in moe_config.items() if k != "num_local_experts"}
    assert "num_local_experts" in moe_config and moe.args_from_config(dict(published, num_experts=4)) == (
        moe.args_from_config(moe_config)
    )
    for adapter, config, family in ((dense, dense_config, "Qwen3"), (moe, moe_config, "Qwen3-MoE")):
        with pytest.raises(ConfigError) as info:
            adapter.args_from_config(dict(config, use_sliding_window=True, sliding_window=64))
        assert str(info.value) == (
            f"config.json has what this {family} cannot represent: use_sliding_window True (flavor: False)"
        )
    with pytest.raises(ConfigError) as info:
        moe.args_from_config(dense_config)
    assert str(info.value) == (
        "config.json lacks num_experts, num_experts_per_tok, moe_intermediate_size: "
        "a Qwen3-MoE model cannot be built from it"
    )
    with pytest.raises(ConfigError, match="cannot represent: decoder_sparse_step 2"):
        moe.args_from_config(dict(moe_config, decoder_sparse_step=2))  # dense blocks between the MoE ones


@pytest.mark.parametrize("case", ["sliding_window", "dense_into_moe", "dense_into_moe_flavor"])
def test_a_qwen3_folder_the_job_cannot_load_is_one_line_exit_2(tmp_path, capsys, case):
    """Refused before anything is trained: one error line, exit 2."""
    import train

    folder = save(_qwen3(False), tmp_path / "hf")
    if case == "sliding_window":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(config, use_sliding_window=True, sliding_window=64)))
        argv, expected = _qwen3_job(False, folder, tmp_path / "job"), "use_sliding_window True (flavor: False)"
    else:  # the folder named, and the model.name that loads it, whether its shape comes from it or not
        flavor = "hf" if case == "dense_into_moe" else "debugmodel"
        argv = _qwen3_job(True, folder, tmp_path / "job", flavor=flavor)
        expected = (
            f"{folder}/config.json is a ['Qwen3ForCausalLM'] model; model.name qwen3_moe loads "
            "Qwen3MoeForCausalLM (model_type qwen3_moe) (model.name qwen3 loads it)"
        )
    capsys.readouterr()
    assert train.main([*argv, "--training.steps", "1"]) == 2
    # (the job's log lines come before the error when it is found after the config is read: the architecture)
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == lines[-1:] and expected in errors[0], lines
    assert not (tmp_path / "job" / "losses.txt").exists()
