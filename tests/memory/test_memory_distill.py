"""The planner counts on-policy distillation (issue 44, item 4): the student trained (weights,
gradients, AdamW state), the teacher frozen like a reference (under model.frozen_sharding, its own
shape: it may be larger), no reference, the teacher's forward in the scoring phase, and with
distill.loss jsd the teacher's forward and the chunked JSD in the update; ``proximal memory --run``
reads a distill config (its model.teacher's config.json) and ``--method distill`` plans from flags.
Every byte count is derived by hand below."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from proximal import memory
from proximal.config import save_config
from proximal.memory.budget import ModelSpec, Setup, plan, training_activation_bytes
from proximal.memory.command import plan_run
from proximal.models.tiny import tiny_config
from proximal.trainers.distill_config import DistillConfig

# The student: the tiny Llama of tests/test_memory_methods.py (V 100, h 64, 3 layers, 4 heads and 2
# KV heads, I 256, untied): N = 197,568 counted by hand there.
V, H = 100, 64  # and I = 256
N_S = 197_568
# The teacher, larger: h 128, 2 layers, 4 heads and 2 KV heads of 32 (kv width 64), I = 4h = 512:
# embedding V·h + 2 x (q 128² + k, v 128·64 each + o 128² + MLP 3·128·512 + two norms of 128)
# + final norm 128 + head V·h.
HT = 128  # and I = 512
N_T = 100 * 128 + 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 512 + 2 * 128) + 128 + 100 * 128
assert N_T == 517_760
# 4 prompts x 2 responses, micro-batch m = 4, P = 16 + T = 16 = s = 32 tokens, float32.
M, P, T = 4, 16, 16
S = P + T


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    tiny_config("llama", V, hidden=H, layers=3, heads=4, kv_heads=2).save_pretrained(d / "student")
    tiny_config("llama", V, hidden=HT, layers=2, heads=4, kv_heads=2).save_pretrained(d / "teacher")
    return d


@pytest.fixture(scope="module")
def archs(dirs):
    return memory.load_architecture(dirs / "student"), memory.load_architecture(dirs / "teacher")


def distill(archs, **kw) -> Setup:
    student, teacher = archs
    base = dict(
        actor=ModelSpec.of(student, "lm"),
        teacher=ModelSpec.of(teacher, "lm"),
        method="distill",
        precision="32-true",
        batch=4,
        group_size=2,
        prompt_len=P,
        response_len=T,
        micro_batch=M,
        logprobs="fused",
        forward_cache=False,
    )
    return Setup(**{**base, **kw})


def test_the_teacher_is_a_frozen_row_of_its_own_size(archs):
    assert archs[1].params("lm") == N_T
    p = plan(distill(archs))
    assert list(p.rows) == ["student", "teacher"]  # no reference: there is no KL term
    s, t = p.rows["student"], p.rows["teacher"]
    # the student trains: 4 + 4 bytes and AdamW's 8 per parameter (32-true)
    assert (s.parameters, s.gradients, s.optimizer) == (N_S * 4, N_S * 4, N_S * 8)
    # the teacher is frozen: its weights alone, float32 under 32-true, bfloat16 under bf16-*
    assert (t.n_params, t.parameters, t.gradients, t.optimizer) == (N_T, N_T * 4, 0, 0)
    assert p.static == N_S * 12 + N_T * 4
    for precision in ("bf16-mixed", "bf16-true"):
        assert plan(distill(archs, precision=precision)).rows["teacher"].parameters == N_T * 2


def test_lora_leaves_the_teacher_whole_and_adds_no_reference(archs):
    """With LoRA the student's base is frozen, but the teacher is another model: never shared."""
    p = plan(distill(archs, lora_rank=4))
    assert list(p.rows) == ["student", "teacher"]
    assert p.rows["teacher"].parameters == N_T * 4


def test_the_teacher_is_sharded_under_frozen_sharding(archs):
    fsdp = dict(gpus=2, strategy="fsdp")
    assert plan(distill(archs, **fsdp)).rows["teacher"].parameters == N_T * 4 // 2
    whole = plan(distill(archs, frozen_sharding="replicate", **fsdp))
    assert whole.rows["teacher"].parameters == N_T * 4


def test_the_scoring_phase_is_the_teacher_s_forward(archs):
    """No-grad forwards of a micro-batch: the largest moment is one layer's MLP, m·s·(2h + 3I)·4 —
    the teacher's 4·32·(256 + 1536)·4 = 917,504 bytes, above the student's π_old pass
    4·32·(128 + 768)·4 = 458,752 and the teacher's end (last hidden states m·s·h_t·4 = 65,536, the
    T scored positions' m·T·h_t·4 = 32,768 and one fused tile of 64 x 100 float32 = 25,600)."""
    p = plan(distill(archs))
    assert p.rows["teacher"].activations == 917_504
    assert p.phases["scoring"] == 917_504
    same = plan(distill(archs, teacher=ModelSpec.of(archs[0], "lm")))
    assert same.phases["scoring"] == 458_752  # a teacher of the student's shape: π_old's alike


def test_the_jsd_update_holds_the_teacher_forward_and_the_chunked_jsd(archs):
    """distill.loss jsd: the update runs the teacher again (no grad) to its last hidden states
    (m·s·h_t·4 = 65,536 bytes, kept), the student to its own with gradients, and the JSD over the
    N = m·T = 64 positions: their hidden states gathered 64·(64 + 128)·4 = 49,152, ∂L/∂h_s
    64·64·4 = 16,384 and ∂L/∂W_s 100·64·4 = 25,600 in float32, and one chunk of all 64 positions
    (2²³ // V ≥ 64) x 10 float32 (64, 100) tensors = 256,000. Under bf16-true both heads are also
    copied to float32: + 100·64·4 + 100·128·4."""
    student, teacher = archs
    s = distill(archs, distill_loss="jsd")
    body = training_activation_bytes(student, s, "score") - M * S * 4  # no head: the hidden states
    assert training_activation_bytes(student, s, "hidden") == body
    jsd = 49_152 + 16_384 + 25_600 + 256_000
    p = plan(s)
    assert p.rows["student"].activations == 65_536 + body + jsd
    assert p.phases["actor update"] == N_S * 4 + 65_536 + body + jsd
    b16 = distill(archs, distill_loss="jsd", precision="bf16-true")
    body16 = training_activation_bytes(student, b16, "hidden")
    # bfloat16: hidden states at 2 bytes (teacher's kept 32,768, gathered 24,576); float32 ∂L/∂h,
    # ∂L/∂W, the chunk; the two float32 head copies 25,600 + 51,200
    jsd16 = 64 * 192 * 2 + 16_384 + 25_600 + 25_600 + 51_200 + 256_000
    assert plan(b16).rows["student"].activations == 32_768 + body16 + jsd16


def _run(tmp_path, dirs, **changes):
    cfg = DistillConfig()
    cfg.model.path = str(dirs / "student")
    cfg.model.teacher = str(dirs / "teacher")
    for dotted, value in changes.items():
        section, field = dotted.split(".")
        setattr(getattr(cfg, section), field, value)
    out = tmp_path / "distill"
    out.mkdir()
    save_config(cfg, out / "config.yaml")
    return out


def test_run_reads_a_distill_config_and_its_teacher(tmp_path, dirs, archs):
    """A run directory's config.yaml names its method by its distill section; the teacher's shape
    comes from model.teacher's config.json; distill.micro_batch_size and distill.loss are read."""
    d = _run(
        tmp_path, dirs, **{"distill.micro_batch_size": 2, "distill.loss": "jsd", "model.lora_r": 4}
    )
    setup, run = plan_run(str(d))
    assert (setup.method, run.teacher_path) == ("distill", str(dirs / "teacher"))
    assert setup.teacher.n_params == N_T and setup.actor.n_params == N_S
    # DistillConfig's defaults: 16 prompts x 1 response, T 32, prompts of 256
    assert (setup.batch, setup.group_size, setup.micro_batch) == (16, 1, 2)
    assert (setup.response_len, setup.prompt_len, setup.distill_loss) == (32, 256, "jsd")
    assert setup.old_logprobs_pass and not setup.reference and setup.lora_rank == 4
    assert list(plan(setup).rows) == ["student", "teacher"]
    # --teacher-config replaces model.teacher's shape
    flagged, _ = plan_run(str(d), teacher_config=str(dirs / "student"))
    assert flagged.teacher.n_params == N_S


def test_the_cli_plans_distill_from_flags_and_from_a_run(tmp_path, dirs, capsys):
    argv = ["--method", "distill", "--config", str(dirs / "student"), "--json"]
    assert memory.cli([*argv, "--teacher-config", str(dirs / "teacher")]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["method"] == "distill" and j["bytes_per_gpu"]["teacher"]["n_params"] == N_T
    # without a teacher flag the teacher has the student's shape
    assert memory.cli(argv) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_gpu"]["teacher"]["n_params"] == N_S
    # the vllm engine samples distill's rollouts as it does GRPO's
    assert memory.cli([*argv, "--engine", "vllm"]) == 0
    assert "vllm engine" in json.loads(capsys.readouterr().out)["bytes_per_gpu"]
    d = _run(tmp_path, dirs)
    assert memory.cli(["--run", str(d), "--units", "MiB"]) == 0
    out = capsys.readouterr().out
    assert "on-policy distillation" in out and "teacher" in out and "verdict: FITS" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--teacher-params", "7B"], "--teacher-config/--teacher-params: grpo has no teacher"),
        (["--method", "distill", "--teacher-params", "0"], "a parameter count must be positive"),
    ],
)
def test_teacher_flag_errors_are_one_line(dirs, capsys, argv, message):
    base = ["--method", "grpo"] if "--method" not in argv else []
    with pytest.raises(SystemExit) as e:
        memory.cli([*base, "--config", str(dirs / "student"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "proximal memory: error:" in err and message in err, err


def test_a_run_without_a_teacher_is_one_line(tmp_path, dirs, capsys):
    hand = tmp_path / "distill.yaml"
    hand.write_text(f"model:\n  path: {dirs / 'student'}\ndistill:\n  loss: reverse_kl\n")
    with pytest.raises(SystemExit) as e:
        memory.cli(["--run", str(hand)])
    assert e.value.code == 2
    assert "model.teacher is not set" in capsys.readouterr().err
    # the flag gives the teacher's shape instead
    setup, _ = plan_run(str(hand), teacher_params=1000)
    assert setup.teacher == ModelSpec(1000) and replace(setup).method == "distill"
