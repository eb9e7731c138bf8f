"""Hugging Face weights in and out (graph_trainer/checkpoint/hf.py), against ``transformers``' own models.

Each model is a random tiny LLaMA-3 / DeepSeek-V3 / Qwen3 / Qwen3-MoE of ``transformers`` saved in
several safetensors files; our job loads it with ``--checkpoint.initial_load_hf`` and its logits on
the same tokens are compared with ``transformers``' (fp32; ``BOUND`` = 3e-6 of the largest logit), on
one process and on FSDP=2, TP=2 (LLaMA; Qwen3 with its output tied to the embedding), EP=2 (DeepSeek,
Qwen3-MoE) and TP=2 x EP=2 with gloo, where each rank must have read exactly the bytes of its own
shards. Then the round trip (load, 0 steps, export, reload: every tensor bitwise),
bf16 folders into fp32 master weights, resuming a converted step-0, and bad folders (one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from graph_trainer.errors import ConfigError
from tests.conftest import ROOT
from tests.hf_models import (
    DEEPSEEK_JOB,
    LLAMA_JOB,
    QWEN3_JOB,
    QWEN3_MOE_JOB,
    deepseek_model,
    file_tensors,
    llama_model,
    logits,
    qwen3_model,
    qwen3_moe_model,
    relative_error,
    save,
)
from tests.launch import read_losses, run_forked

COMMON = ["--job.device", "cpu", "--compile.mode", "eager", "--metrics.enable_tensorboard", "False"]
FAMILIES = {
    "llama": (llama_model, LLAMA_JOB, "2MB"),
    "deepseek": (deepseek_model, DEEPSEEK_JOB, "8MB"),
    "qwen3": (qwen3_model, QWEN3_JOB, "2MB"),
    "qwen3_moe": (qwen3_moe_model, QWEN3_MOE_JOB, "4MB"),
}
BOUND = 3e-6
"""Largest logit difference / largest logit, fp32 (measured up to 9.3e-7, Qwen3; the issue asked for 1e-5). Why
the two are not bitwise: test_llama_differs_from_transformers_only_by_its_rope_table_and_the_order_of_head_dims."""


def _job(family: str, folder: Path, dump: Path, *extra: str) -> list[str]:
    job = [os.path.join(ROOT, a) if a.endswith(".toml") else a for a in FAMILIES[family][1]]
    return [*job, *COMMON, "--checkpoint.initial_load_hf", str(folder), "--job.dump_folder", str(dump), *extra]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (transformers model, its folder in several files, tokens, transformers' logits)."""
    out = {}
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    for family, (build, _, shard) in FAMILIES.items():
        model = build()
        folder = save(model, tmp_path_factory.mktemp(family) / "hf", max_shard_size=shard)
        assert len(list(folder.glob("*.safetensors"))) > 2
        out[family] = (model, folder, tokens, logits(model, tokens))
    return out


def _probe(tmp_path, argv):
    from graph_trainer.config_loading import load_config
    from graph_trainer.validation import validate_config
    from tests.hf_probe import probe

    cfg = load_config(argv)
    validate_config(cfg)
    return probe(cfg, torch.load(tmp_path / "tokens.pt"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_process_computes_transformers_logits(tmp_path, models, family):
    _, folder, tokens, reference = models[family]
    torch.save(tokens, tmp_path / "tokens.pt")
    ours, nbytes, local, _ = _probe(tmp_path, _job(family, folder, tmp_path / "job"))
    error = relative_error(ours, reference)
    print(f"{family} one process: largest logit difference / largest logit = {error:.2e}")
    assert error < BOUND
    assert nbytes == 4 * local  # fp32 files: the whole model, each byte once


def test_llama_differs_from_transformers_only_by_its_rope_table_and_the_order_of_head_dims(models, monkeypatch):
    """Why the logits are not bitwise: given transformers' cos/sin (angles formed in float32, ours in
    float64) and q, k with their head dims in rotate-half order (so that q.k sums in the same order),
    our LLaMA computes transformers' logits bitwise."""
    import torch.nn.functional as F

    import models.llama3.model as llama
    import models.sequence as sequence
    from models.llama3.flavors import FLAVORS
    from models.llama3.hf import sources

    model, _, tokens, reference = models["llama"]
    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2)
    ours = llama.Transformer(args)
    theirs = model.state_dict()
    with torch.no_grad():
        for fqn, param in ours.named_parameters():
            param.copy_(sources(args)[fqn].read(lambda n, i: theirs[n][i], [0] * param.dim(), list(param.shape)))
        assert 0 < relative_error(ours(tokens).float(), reference) < BOUND
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(args.max_seq_len)[None])
        half = args.head_dim // 2
        ours.rope_cache = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float()
        rotate_half_order = torch.cat([torch.arange(0, args.head_dim, 2), torch.arange(1, args.head_dim, 2)])

        def attention(q, k, v, **kwargs):
            return F.scaled_dot_product_attention(q[..., rotate_half_order], k[..., rotate_half_order], v, **kwargs)

        monkeypatch.setattr(sequence, "F", SimpleNamespace(scaled_dot_product_attention=attention))
        assert torch.equal(ours(tokens).float(), reference)


LAYOUTS = {
    "llama_fsdp2": ("llama", ["--parallelism.dp_shard", "2"]),
    "llama_tp2": ("llama", ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"]),
    "deepseek_ep2": ("deepseek", ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
    # sequence parallel, the experts split over the two tp ranks, each routing its own tokens
    "deepseek_tp2xep2": ("deepseek", ["--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--parallelism.ep", "2"]),
    # the output tied to the embedding, both split over the vocabulary; the QK norms on each rank's heads
    "qwen3_tp2": ("qwen3", ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"]),
    "qwen3_moe_ep2": ("qwen3_moe", ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
    "qwen3_moe_tp2xep2": (
        "qwen3_moe",
        ["--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--parallelism.ep", "2"],
    ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_rank_reads_only_its_shards_and_computes_transformers_logits(tmp_path, models, layout):
    family, degrees = LAYOUTS[layout]
    _, folder, tokens, reference = models[family]
    torch.save(tokens, tmp_path / "tokens.pt")
    out = tmp_path / "probe"
    out.mkdir()
    argv = _job(family, folder, tmp_path / "job", *degrees)
    run_forked(2, os.path.join(ROOT, "tests", "hf_probe.py"), str(out), str(tmp_path / "tokens.pt"), *argv)
    error = relative_error(torch.load(out / "logits.pt"), reference)
    print(f"{layout}: largest logit difference / largest logit = {error:.2e}")
    assert error < BOUND
    whole = sum(os.path.getsize(f) for f in folder.glob("*.safetensors"))
    for rank in range(2):
        report = json.loads((out / f"rank{rank}.json").read_text())
        # exactly the bytes of this rank's shards (fp32 files), and well short of the whole model
        assert report["bytes_read"] == 4 * report["local_elements"], report
        assert report["bytes_read"] < 0.75 * whole
        print(f"{layout} rank {rank}: read {report['bytes_read']:,} of the folder's {whole:,} bytes")


def test_bf16_folder_loads_exactly_into_fp32_master_weights(tmp_path):
    from graph_trainer.checkpoint.state import model_tensors
    from graph_trainer.config_loading import load_config
    from graph_trainer.trainer import Trainer
    from models.llama3.hf import sources
    from models.registry import model_args

    folder = save(llama_model(seed=3), tmp_path / "hf", dtype=torch.bfloat16)
    cfg = load_config(_job("llama", folder, tmp_path / "job"))
    trainer = Trainer(cfg)
    theirs = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in theirs.values()} == {torch.bfloat16}
    source = sources(model_args(cfg))
    for fqn, ours in model_tensors(trainer.model).items():
        assert ours.dtype == torch.float32, fqn
        for name, value in source[fqn].to_hf(ours).items():
            assert torch.equal(value, theirs[name].float()), name
    assert trainer.hf_bytes_read == sum(t.numel() * 2 for t in theirs.values())


def _convert_and_export(tmp_path, family: str, folder: Path) -> Path:
    """Load ``folder`` at step 0, save step-0 (training.steps 0), export it; returns the exported folder."""
    from graph_trainer.cli import export_hf
    from graph_trainer.config_loading import load_config
    from graph_trainer.trainer import Trainer
    from graph_trainer.validation import validate_config

    cfg = load_config(_job(family, folder, tmp_path / "job", "--training.steps", "0", "--checkpoint.interval", "1"))
    validate_config(cfg)
    assert Trainer(cfg).train() == []
    out = tmp_path / "exported"
    argv = ["--checkpoint", str(tmp_path / "job" / "checkpoint"), "--step", "0", "--out", str(out)]
    assert export_hf.main([*argv, "--max_shard_gb", "0.004"]) == 0
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_export_reload_is_bitwise(tmp_path, models, family):
    from transformers import AutoModelForCausalLM

    model, folder, tokens, reference = models[family]
    out = _convert_and_export(tmp_path, family, folder)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    original, exported = file_tensors(folder), file_tensors(out)
    assert sorted(original) == sorted(exported)
    unequal = [n for n in original if not torch.equal(original[n], exported[n])]
    assert not unequal, unequal
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs, again = model.state_dict(), reloaded.state_dict()
    assert sorted(theirs) == sorted(again)
    assert all(torch.equal(theirs[k], again[k]) for k in theirs)
    assert torch.equal(logits(reloaded.eval(), tokens), reference)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_export_keeps_the_other_config_fields_of_the_folder_it_came_from(tmp_path, models, family):
    """``--config_from``: the folder's fields we do not write (token ids, ...) carried over, ours
    as without it; a float8 release's quantization_config and dtype are not the export's."""
    from graph_trainer.checkpoint.hf import carried_config
    from graph_trainer.cli import export_hf
    from models.registry import MODEL_SPECS

    _, folder, _, _ = models[family]
    plain = json.loads((_convert_and_export(tmp_path, family, folder) / "config.json").read_text())
    out = tmp_path / "carried"
    argv = ["--checkpoint", str(tmp_path / "job" / "checkpoint"), "--step", "0", "--out", str(out)]
    assert export_hf.main([*argv, "--config_from", str(folder)]) == 0
    theirs, carried = json.loads((folder / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {"bos_token_id", "eos_token_id"} <= theirs.keys() - plain.keys()
    (spec,) = [s for s in MODEL_SPECS.values() if s.hf.model_type == plain["model_type"]]
    # each field once: the other name transformers wrote it under (Qwen3-MoE's expert count) left out
    aliases = {k for k, name in spec.hf.field_aliases.items() if name in plain}
    assert aliases <= theirs.keys() and carried == {k: v for k, v in {**theirs, **plain}.items() if k not in aliases}

    release = tmp_path / "release"
    release.mkdir()
    quantized = {**theirs, "quantization_config": {"quant_method": "fp8"}, "dtype": "float8_e4m3fn"}
    (release / "config.json").write_text(json.dumps(quantized))
    args = spec.hf.args_from_config(plain)
    kept = carried_config(plain, str(release), spec.hf, args)
    assert "quantization_config" not in kept and kept["dtype"] == plain["torch_dtype"] == "float32"
    for alias, name in spec.hf.field_aliases.items():  # under both names, the folder's must agree with ours
        (release / "config.json").write_text(json.dumps({**theirs, alias: plain[name] * 2}))
        with pytest.raises(ConfigError, match=f"describes another model than the checkpoint: {alias} "):
            carried_config(plain, str(release), spec.hf, args)


def test_export_mistakes_are_one_line_exit_2(tmp_path, models, capsys):
    from graph_trainer.cli import export_hf

    out = _convert_and_export(tmp_path, "llama", models["llama"][1])
    capsys.readouterr()
    checkpoint = str(tmp_path / "job" / "checkpoint")
    for argv, expected in (
        (["--checkpoint", checkpoint, "--step", "0", "--out", str(out)], f"error: output folder {out} already exists"),
        (["--checkpoint", checkpoint, "--step", "7", "--out", str(tmp_path / "x")], "error: "),
        (
            ["--checkpoint", checkpoint, "--step", "0", "--out", str(tmp_path / "x"), "--tokenizer", str(tmp_path)],
            f"error: tokenizer folder {tmp_path} holds no tokenizer.json",
        ),
        (
            ["--checkpoint", checkpoint, "--step", "0", "--out", str(tmp_path / "x")]
            + ["--config_from", str(models["deepseek"][1])],
            f"error: {models['deepseek'][1]}/config.json describes another model than the checkpoint: "
            "model_type 'deepseek_v3', not 'llama'",
        ),
        (["--checkpoint", checkpoint, "--step", "zero", "--out", "x"], "error: argument --step: invalid int value"),
        (["--checkpoint", checkpoint, "--out", "x"], "error: the following arguments are required: --step"),
    ):
        assert export_hf.main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected), (argv, lines)
    assert not (tmp_path / "x").exists()


def test_resuming_a_converted_step_0_trains_as_loading_directly(tmp_path, models):
    """A fine-tuning job started from the folder, and one resumed from the folder converted to step-0,
    train bitwise alike (the folder also serves as the tokenizer's)."""
    from graph_trainer.config_loading import load_config
    from graph_trainer.trainer import Trainer
    from tests.data.test_tokenizer import train_word_level

    _, folder, _, _ = models["llama"]
    tuned = tmp_path / "hf"
    tuned.mkdir()
    for file in folder.iterdir():
        (tuned / file.name).write_bytes(file.read_bytes())
    words = [f"w{i}" for i in range(300)]
    train_word_level([" ".join(words)]).save(str(tuned / "tokenizer.json"))
    run = ["--training.steps", "3", "--training.seq_len", "32", "--training.local_batch_size", "2"]
    run += ["--training.tokenizer_path", str(tuned), "--checkpoint.interval", "3"]
    losses = []
    for name, extra in (("direct", []), ("converted", ["--training.steps", "0", "--checkpoint.interval", "1"])):
        cfg = load_config(_job("llama", tuned, tmp_path / name, *run, *extra))
        Trainer(cfg).train()
    cfg = load_config(_job("llama", tuned, tmp_path / "converted", *run))
    Trainer(cfg).train()
    for name in ("direct", "converted"):
        losses.append(read_losses(tmp_path / name))
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    # the fine-tuned model handed back with its tokenizer
    from graph_trainer.cli import export_hf

    out = tmp_path / "tuned_out"
    argv = ["--checkpoint", str(tmp_path / "direct" / "checkpoint"), "--step", "3", "--out", str(out)]
    assert export_hf.main([*argv, "--tokenizer", str(tuned), "--dtype", "bfloat16"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tuned / "tokenizer.json").read_bytes()
    assert {t.dtype for t in file_tensors(out).values()} == {torch.bfloat16}


def test_deepseek_multi_token_prediction_layers_are_skipped_only_when_declared(tmp_path, models):
    """DeepSeek-V3 releases hold layer 61 (the MTP module, ``num_nextn_predict_layers``), which we do not train."""
    from graph_trainer.checkpoint.hf import open_hf_weights
    from graph_trainer.config_loading import load_config
    from models.registry import model_args

    folder = tmp_path / "hf"
    folder.mkdir()
    for file in models["deepseek"][1].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    save_file({"model.layers.3.eh_proj.weight": torch.ones(4, 4)}, str(folder / "mtp.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.3.eh_proj.weight"] = "mtp.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = load_config(_job("deepseek", folder, tmp_path / "job"))
    config = json.loads((folder / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    weights = open_hf_weights(cfg, model_args(cfg))
    assert weights.skipped == ["model.layers.3.eh_proj.weight"]
    (folder / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    with pytest.raises(ConfigError, match="unexpected model.layers.3.eh_proj.weight"):
        open_hf_weights(cfg, model_args(cfg))


def _bad_folder(case: str, folder: Path, tmp_path: Path, models) -> tuple[str, list[str], str]:
    """(family, extra flags, start of the expected error line) of one bad folder made from ``folder``."""
    bad = tmp_path / "bad"
    if case == "missing_folder":
        return "llama", [], f"error: Hugging Face folder {bad} does not exist"
    bad.mkdir()
    for file in folder.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    files = sorted(bad.glob("*.safetensors"))
    if case == "wrong_architecture":
        for file in bad.iterdir():
            file.unlink()
        for file in models["deepseek"][1].iterdir():
            (bad / file.name).write_bytes(file.read_bytes())
        expected = f"error: {bad}/config.json is a ['DeepseekV3ForCausalLM'] model; model.name llama3 loads "
        return "llama", [], expected + "LlamaForCausalLM (model_type llama) (model.name deepseek_v3 loads it)"
    if case == "config_shape":
        config = json.loads((bad / "config.json").read_text())
        config["intermediate_size"] = 1024
        (bad / "config.json").write_text(json.dumps(config))
        expected = f"error: {bad}/config.json does not fit llama3 debugmodel (2 layers): intermediate_size 1024"
        return "llama", [], expected
    if case in ("missing_tensor", "tensor_shape", "non_finite"):
        name = "model.layers.1.mlp.up_proj.weight"
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        file = bad / index["weight_map"][name]
        tensors = load_file(str(file))
        if case == "missing_tensor":
            del tensors[name]
            del index["weight_map"][name]
            (bad / "model.safetensors.index.json").write_text(json.dumps(index))
            expected = f"error: {bad} does not hold the tensors of llama3 debugmodel (2 layers): missing {name}"
        elif case == "tensor_shape":
            tensors[name] = tensors[name][:-1]
            expected = f"error: {bad} does not hold the tensors of llama3 debugmodel (2 layers): shape {name} [767,"
        else:
            tensors[name][3, 5] = float("nan")
            expected = f"error: {bad}: tensor layers.1.feed_forward.w3.weight holds non-finite values"
        save_file(tensors, str(file), metadata={"format": "pt"})
        return "llama", [], expected
    if case == "truncated_file":
        data = files[1].read_bytes()
        files[1].write_bytes(data[: len(data) // 2])
        return "llama", [], f"error: safetensors file {files[1]} cannot be read (truncated or corrupt?)"
    if case == "corrupt_header":
        data = bytearray(files[0].read_bytes())
        data[8:16] = b"{garbage"
        files[0].write_bytes(bytes(data))
        return "llama", [], f"error: safetensors file {files[0]} cannot be read (truncated or corrupt?)"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "missing_folder",
        "wrong_architecture",
        "config_shape",
        "missing_tensor",
        "tensor_shape",
        "non_finite",
        "truncated_file",
        "corrupt_header",
    ],
)
def test_bad_folder_is_one_line_exit_2_and_nothing_trains(tmp_path, capsys, models, case):
    import train

    family, extra, expected = _bad_folder(case, models["llama"][1], tmp_path, models)
    dump = tmp_path / "job"
    assert train.main(_job(family, tmp_path / "bad", dump, "--training.steps", "2", *extra)) == 2
    # (the job's log lines come before the error when it is found after building: non_finite)
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == lines[-1:] and errors[0].startswith(expected), lines
    assert not (dump / "losses.txt").exists() or not (dump / "losses.txt").read_text().strip()
    assert not (dump / "checkpoint").exists() or not list((dump / "checkpoint").iterdir())
