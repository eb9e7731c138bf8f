"""benchmarks/stage_breakdown.py on a two-stage debug job (FSDP=2 in each stage): its lines add up, a
variant gets its column."""

import json

from benchmarks import stage_breakdown
from tests.conftest import ROOT

JOB = [
    "--job.config_file", f"{ROOT}/configs/llama3_debug.toml", "--parallelism.pp", "2",
    "--training.global_batch_size", "4", "--training.local_batch_size", "1", "--compile.backend", "inductor",
]  # fmt: skip


def test_a_stage_pieces_and_a_variant(tmp_path, capsys):
    out = tmp_path / "breakdown.json"
    # (FSDP=2 in each stage, weights gathered per microbatch: the forward holds all-gathers)
    argv = [*JOB, "--world_size", "4", "--parallelism.fsdp_collectives", "per_microbatch", "--stage", "1"]
    argv += ["--variant", "--float8.recipe_name tensorwise", "--json", str(out)]
    assert stage_breakdown.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["variants"] == ["the job", "the job with --float8.recipe_name tensorwise"]
    bf16, fp8 = data["pieces"]
    assert set(bf16) == set(fp8) == {"F", "B"}
    for lines in (bf16["F"], bf16["B"], fp8["B"]):
        classes = {k.strip(): v for k, v in lines.items() if k.startswith("    ")}
        assert abs(sum(classes.values()) - lines["compute"]) < 1e-6
        matmuls = sum(v for k, v in classes.items() if k in stage_breakdown.MATMUL_CLASSES)
        assert abs(matmuls - lines["  matmuls"]) < 1e-6 and lines["  matmuls"] > 0
        assert lines["time"] >= lines["compute"]
    assert "    scaled_mm_tensorwise" in fp8["F"] and "    scaled_mm_tensorwise" not in bf16["F"]
    printed = capsys.readouterr().out
    assert "-- all pieces: against the first column" in printed and "(1.000x)" in printed
    forward = printed.split("-- F (ms)")[1].split("-- B (ms)")[0].splitlines()
    names = [line[:32].rstrip() for line in forward if line.strip()]
    classes = [i for i, n in enumerate(names) if n.startswith("    ")]
    # (a class of the variant alone is listed with the others, before the collectives)
    assert any(n.startswith("all_gather") for n in names[classes[-1] :])
    assert classes == list(range(classes[0], classes[-1] + 1)) and "    scaled_mm_tensorwise" in names
    assert [names[i] for i in classes] == sorted(names[i] for i in classes)


def test_a_stage_the_job_lacks_is_one_line_exit_2(capsys):
    assert stage_breakdown.main([*JOB, "--world_size", "2", "--stage", "5"]) == 2
    assert capsys.readouterr().err.strip() == "error: --stage 5: the job has stages 0..1"
