"""The planner for every method: the models each method holds and the terms of its step, derived by
hand; the meta-device counts against the loaded test models; ``proximal memory --run`` reading a
run's config (and refusing what it cannot plan, in one line); and — marked slow — each method's real
trainer step measured on the CPU within ±15 % of its plan (benchmarks/memory_methods.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from proximal import memory
from proximal.config import save_config
from proximal.memory.budget import (
    Setup,
    autocast_copies,
    forward_only_bytes,
    plan,
    precision_bytes,
    training_activation_bytes,
)
from proximal.memory.command import plan_run
from proximal.memory.runconfig import read_run
from proximal.memory.search import largest_micro_batch
from proximal.models.tiny import ARCHITECTURES, tiny_config

ROOT = Path(__file__).resolve().parents[1]

# The tiny Llama of tests/test_memory.py: V 100, h 64, 3 layers, 4 heads, 2 KV heads (kv width 32),
# I 256; N(lm) = 197,568 by hand there, and the one-label scorer drops the head (100 x 64) for h.
N_LM, N_SCORE = 197_568, 197_568 - 100 * 64 + 64


@pytest.fixture(scope="module")
def arch():
    return memory.architecture_from_config(
        tiny_config("llama", 100, hidden=64, layers=3, heads=4, kv_heads=2).to_dict()
    )


def spec(arch, head="lm"):
    return memory.ModelSpec.of(arch, head)


# ---- meta-device counts ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch_name", ARCHITECTURES)
def test_meta_device_counts_equal_the_loaded_models(assets, arch_name):
    """Counted on the meta device from config.json alone = ``numel`` of the checkpoint as loaded."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy, rm = assets.policy(arch_name), assets.reward_model(arch_name)
    loaded_lm = AutoModelForCausalLM.from_pretrained(policy)
    loaded_rm = AutoModelForSequenceClassification.from_pretrained(rm)
    assert memory.load_architecture(policy).params("lm") == sum(
        p.numel() for p in loaded_lm.parameters()
    )
    assert memory.load_architecture(rm).params("score") == sum(
        p.numel() for p in loaded_rm.parameters()
    )


def test_the_tiny_llama_counts_by_hand(arch):
    assert (arch.params("lm"), arch.params("score")) == (N_LM, N_SCORE)
    assert arch.lm_head_params() == 100 * 64 and arch.embedding_params == 100 * 64
    # q 64x64, k and v 64x32, o 64x64, MLP 3 x 64x256, two norms of 64
    assert arch.layer_params() == 2 * 4096 + 2 * 2048 + 3 * 16384 + 128
    assert arch.gated_mlp and arch.rms_norm and not arch.tie_word_embeddings


def test_an_unknown_model_type_is_refused_in_one_line():
    with pytest.raises(memory.ConfigReadError, match="model_type 'no-such-model' is not one"):
        memory.architecture_from_config({"model_type": "no-such-model"}, "x/config.json")


# ---- the models each method holds ------------------------------------------------------------------


def test_the_models_of_each_method(arch):
    """Rows and static bytes at 32-true: weights 4 + AdamW 8 per trained parameter (the gradients, 4
    more, live only in the update), 4 per frozen one."""
    lm, sc = spec(arch), spec(arch, "score")

    def make(method, **kw):
        return plan(
            Setup(actor=sc if method == "rm" else lm, method=method, precision="32-true", **kw)
        )

    ppo = plan(Setup(actor=lm, critic=sc, reward=sc, precision="32-true"))
    assert list(ppo.rows) == ["actor", "critic", "reference", "reward"]
    # weights 4 + AdamW 8 for actor and critic; weights 4 for reference and reward model
    assert ppo.static == 12 * N_LM + 12 * N_SCORE + 4 * N_LM + 4 * N_SCORE
    grpo = make("grpo", reward=sc, group_size=4)
    assert list(grpo.rows) == ["actor", "reference", "reward"]
    assert grpo.static == 12 * N_LM + 4 * N_LM + 4 * N_SCORE
    assert list(make("grpo", reference=False).rows) == ["actor"]  # β = 0, verifiers only
    assert list(make("rloo", reference=False, reward=sc).rows) == ["actor", "reward"]
    assert make("dpo").static == 12 * N_LM + 4 * N_LM
    assert list(make("dpo", precompute_ref=True).rows) == ["policy"]
    for method in ("simpo", "sft"):
        p = make(method)
        assert list(p.rows) == ["policy"] and p.static == 12 * N_LM
    rm = make("rm")
    assert list(rm.rows) == ["model"] and rm.static == 12 * N_SCORE
    # bf16-true: 2 + 2 + 4 bytes per trained parameter; bf16-mixed: float32 master weights and
    # AdamW state (4 + 8), frozen models in bfloat16 (2).
    sft16 = plan(Setup(actor=lm, method="sft", precision="bf16-true"))
    assert sft16.static == 6 * N_LM and sft16.rows["policy"].gradients == 2 * N_LM
    dpo_mixed = plan(Setup(actor=lm, method="dpo", precision="bf16-mixed"))
    assert dpo_mixed.static == 12 * N_LM + 2 * N_LM


def test_a_reward_model_from_a_causal_lm_holds_its_unused_head(arch):
    """transformers keeps the causal LM's output head (V x h) alive after loading it as a scorer."""
    s = Setup(actor=spec(arch, "score"), method="rm", precision="32-true")
    assert plan(s).rows["model"].parameters == 4 * N_SCORE
    causal = replace(arch, checkpoint_class="LlamaForCausalLM")
    from_lm = plan(replace(s, actor=spec(causal, "score"))).rows["model"]
    assert from_lm.parameters == 4 * N_SCORE + 4 * 100 * 64 and "unused output head" in from_lm.note


def test_only_a_scorer_loaded_from_a_causal_lm_holds_its_head(tmp_path, model_dir):
    """--run with model.critic: policy loads the critic from the policy's causal-LM checkpoint (its
    head kept); the flags' default reward model and critic only share the actor's shape."""
    import json as json_

    cfg = json_.loads((model_dir / "config.json").read_text())
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json_.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    d = run_dir(tmp_path, "ppo", causal, **{"model.critic": "policy"})
    setup, _ = plan_run(str(d))
    p = plan(setup)
    assert p.rows["critic"].parameters == 4 * N_SCORE + 4 * 100 * 64
    assert p.rows["reward"].parameters == 4 * N_SCORE  # frozen: loaded as the scorer it must be
    flags = memory.command.build_parser().parse_args(["--config", str(causal)])
    setup, _ = memory.command.setup_from_args(flags, memory.command.build_parser())
    assert plan(setup).rows["critic"].parameters == 2 * N_SCORE  # --dtype bfloat16, no extra head


def test_lora_shares_the_reference_and_trains_only_adapters(arch):
    adapters = (
        33_792  # rank 8 on every linear layer of the 3 blocks (tests/test_memory.py, by hand)
    )
    lm, sc = spec(arch), spec(arch, "score")
    ppo = plan(Setup(actor=lm, critic=sc, reward=sc, lora_rank=8, precision="32-true"))
    assert ppo.rows["reference"].parameters == 0  # the actor with its adapters off: 3 models held
    assert ppo.rows["actor"].trainable == adapters
    assert ppo.rows["actor"].parameters == 4 * N_LM + 4 * adapters  # the frozen base + adapters
    assert ppo.rows["actor"].optimizer == 8 * adapters
    assert ppo.rows["critic"].trainable == adapters + 64  # + the value head, trained in full
    no_critic_lora = plan(replace(ppo.setup, critic_lora=False))
    assert no_critic_lora.rows["critic"].trainable == N_SCORE
    dpo = plan(Setup(actor=lm, method="dpo", lora_rank=8, precompute_ref=True, precision="32-true"))
    assert list(dpo.rows) == ["policy", "reference"] and dpo.rows["reference"].parameters == 0
    # a target list: q_proj and v_proj only, r * (64 + 64) + r * (64 + 32) per block
    assert arch.lora_params(8, ["q_proj", "v_proj"]) == 3 * 8 * (128 + 96)


# ---- the terms of a step, by hand ------------------------------------------------------------------


def test_fused_and_logits_heads_by_hand(arch):
    """SFT, one micro-batch of m = 2 rows of s = 17 tokens, n = 16 scored positions, float32."""
    s = Setup(
        actor=spec(arch),
        method="sft",
        precision="32-true",
        batch=2,
        micro_batch=2,
        max_length=17,
        forward_cache=False,
        logprobs="fused",
    )
    layers = 2 * 17 * 3 * 4 * 1664  # m * s * L * a, a = 1664 elements (tests/test_memory.py)
    final = 2 * 17 * 3 * 64 * 4  # the final norm: x, normed x, output
    hidden = 2 * 16 * 64 * 4  # the scored positions' hidden states, kept for backward
    # fused: V = 100 is one vocabulary block and 2**23 // 100 = 83,886 > 32 positions, so one tile
    # of 32 x 100; forward: the product, exp'd in place for the logsumexp (4 bytes); backward: the
    # product and the gradient (2 x 4 bytes), the hidden states' gradient and the head's float32
    # 100 x 64 gradient
    forward, backward = 32 * 100 * 4, 32 * 100 * 8 + hidden + 100 * 64 * 4
    assert backward > forward
    assert training_activation_bytes(arch, s, "lm") == layers + final + hidden + backward
    # logits: 2 x 16 x 100 float32 logits kept, and their gradient (as large) in backward; the
    # log-softmax workspace in forward holds min(1024 // 16, 2) x 16 pairs x 100: as large again
    logits = 2 * 16 * 100 * 4
    assert training_activation_bytes(arch, replace(s, logprobs="logits"), "lm") == (
        layers + final + hidden + logits + logits
    )
    # without gradients: the larger of one layer's working set and the end (hidden + the head)
    working = 2 * 17 * 4 * (2 * 64 + 3 * 256)
    end = 2 * 17 * 64 * 4 + hidden + forward
    assert forward_only_bytes(arch, s, "lm") == max(working, end)


def test_pairs_are_two_sequences_and_dpo_holds_the_reference_forward(arch):
    base = dict(actor=spec(arch), precision="32-true", batch=4, micro_batch=2, max_length=17)
    simpo, dpo = plan(Setup(method="simpo", **base)), plan(Setup(method="dpo", **base))
    s = simpo.setup
    assert simpo.rows["policy"].activations == training_activation_bytes(arch, s, "lm", rows=4)
    assert simpo.phases == {"update": 4 * N_LM + simpo.rows["policy"].activations}
    # DPO's reference forward runs after the policy's forward and before its backward: on top of
    # what the policy keeps, the larger of the reference's forward and the head's backward
    kept, extra = training_activation_bytes(arch, s, "lm", rows=4, split=True)
    ref = forward_only_bytes(arch, s, "lm", rows=4)
    assert dpo.phases["update"] == 4 * N_LM + kept + max(extra, ref)


def test_online_phases_by_hand(arch):
    """GRPO: B = ⌈4 prompts / 1 GPU⌉ x 4 responses = 16 rollout sequences; no π_old pass when the
    batch gets one optimizer step; the update is the actor's gradients + one micro-batch."""
    lm, sc = spec(arch), spec(arch, "score")
    s = Setup(
        actor=lm,
        reward=sc,
        method="grpo",
        precision="32-true",
        batch=4,
        group_size=4,
        micro_batch=8,
        prompt_len=10,
        response_len=6,
        forward_cache=False,
        logprobs="fused",
        old_logprobs_pass=False,
    )
    p = plan(s)
    assert s.rollout_batch_per_gpu == 16
    assert p.rows["actor"].kv_cache == 16 * 16 * 2 * 3 * 32 * 4
    assert p.phases["scoring"] == max(
        forward_only_bytes(arch, s, "score"), forward_only_bytes(arch, s, "lm")
    )
    assert p.phases["actor update"] == 4 * N_LM + training_activation_bytes(
        arch, s, "lm", entropy=True
    )
    with_old = plan(replace(s, reference=False, reward=None, old_logprobs_pass=True))
    assert with_old.phases["scoring"] == forward_only_bytes(arch, s, "lm")
    assert plan(replace(s, reference=False, reward=None)).phases["scoring"] == 0


def test_bf16_mixed_terms_by_hand(arch):
    """One device: autocast's bfloat16 copy of every linear weight (the untied head included, the
    embedding not) lives through the pass; the residual stream stays float32, + 6h bytes per norm."""
    s = Setup(actor=spec(arch), method="sft", precision="bf16-mixed", micro_batch=1, batch=1)
    assert precision_bytes(s).compute == 2
    assert autocast_copies(arch, s) == 2 * (N_LM - 100 * 64)
    assert autocast_copies(arch, replace(s, gpus=2, strategy="fsdp")) == 0  # FSDP2 casts units
    s1 = replace(s, max_length=17)
    s2 = replace(s1, precision="bf16-true")  # the same bytes per element, a bfloat16 stream
    diff = training_activation_bytes(arch, s1, "lm") - training_activation_bytes(arch, s2, "lm")
    assert diff == 17 * (3 * 2 * 6 * 64 + 6 * 64)  # 2 norms x 6h per layer, 3 layers, + final norm
    eager = replace(s2, attention="eager")
    extra = training_activation_bytes(arch, eager, "lm") - training_activation_bytes(arch, s2, "lm")
    assert extra == 17 * 3 * 4 * 17 * (4 + 2)  # s tokens x L x heads x s probabilities x (4 + b)


def test_largest_micro_batch_searches_the_divisors(arch):
    s = Setup(actor=spec(arch), method="sft", precision="32-true", batch=8, max_length=64)
    peaks = {m: plan(replace(s, micro_batch=m)).peak for m in (1, 2, 4, 8)}
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8]
    budget = (peaks[4] + peaks[8]) // 2
    assert largest_micro_batch(replace(s, gpu_memory=budget)) == 4
    assert largest_micro_batch(replace(s, gpu_memory=peaks[1] - 1)) is None


# ---- --run: a run's config -------------------------------------------------------------------------


CONFIGS = {
    "ppo": ("proximal.trainers.ppo_config", "PPOConfig"),
    "grpo": ("proximal.trainers.grpo_config", "GRPOConfig"),
    "dpo": ("proximal.trainers.dpo_config", "DPOConfig"),
    "simpo": ("proximal.trainers.dpo_config", "SimPOConfig"),
    "sft": ("proximal.trainers.sft_config", "SFTConfig"),
    "rm": ("proximal.trainers.reward_config", "RMConfig"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    tiny_config("llama", 100, hidden=64, layers=3, heads=4, kv_heads=2).save_pretrained(d)
    return d


def run_dir(tmp_path: Path, method: str, model_dir: Path, **changes) -> Path:
    """A run directory's config.yaml as the command writes it: the whole default config, the model
    set, data files that do not exist."""
    module, name = CONFIGS["grpo" if method == "rloo" else method]
    cfg = getattr(importlib.import_module(module), name)()
    cfg.model.path = str(model_dir)
    if method == "ppo":
        cfg.model.reward_model = str(model_dir)
    if method == "rloo":
        cfg.grpo.advantage = "rloo"
    for dotted, value in changes.items():
        section, field = dotted.split(".")
        setattr(getattr(cfg, section), field, value)
    out = tmp_path / method
    out.mkdir(parents=True)
    save_config(cfg, out / "config.yaml")
    return out


@pytest.mark.parametrize("method", ["ppo", "grpo", "rloo", "dpo", "simpo", "sft", "rm"])
def test_a_run_directory_names_its_method(tmp_path, model_dir, method):
    run = read_run(run_dir(tmp_path, method, model_dir))
    assert run.method == method and run.actor_path == str(model_dir)


def test_run_reads_the_fields_a_plan_needs(tmp_path, model_dir):
    """The defaults of each command where the file leaves them (here: the whole default config), and
    no data file or reward function exists."""
    ppo, _ = plan_run(str(run_dir(tmp_path, "ppo", model_dir)))
    assert (ppo.method, ppo.batch, ppo.micro_batch, ppo.mini_batch) == ("ppo", 16, 4, 8)
    assert (ppo.prompt_len, ppo.response_len, ppo.precision, ppo.logprobs) == (
        256,
        32,
        "32-true",
        "fused",
    )
    assert not ppo.forward_cache and ppo.critic is ppo.reward  # the critic starts from r_ψ
    grpo, _ = plan_run(str(run_dir(tmp_path, "grpo", model_dir, **{"grpo.beta": 0.0})))
    assert (grpo.batch, grpo.group_size, grpo.micro_batch) == (16, 8, 4)
    assert grpo.reward is None and not grpo.reference and not grpo.old_logprobs_pass
    assert list(plan(grpo).rows) == ["actor"]  # β = 0 and verifiers only: one model
    mu2, _ = plan_run(str(run_dir(tmp_path / "mu", "grpo", model_dir, **{"grpo.iterations": 2})))
    assert mu2.old_logprobs_pass and mu2.reference
    assert grpo.rollout_precision is None
    bf16, _ = plan_run(
        str(run_dir(tmp_path / "bf16", "grpo", model_dir, **{"rollout.precision": "bf16-true"}))
    )
    assert bf16.rollout_precision == "bf16-true" and "rollout copy" in plan(bf16).rows
    dpo, _ = plan_run(
        str(
            run_dir(
                tmp_path,
                "dpo",
                model_dir,
                **{"train.precompute_ref_logprobs": True, "data.max_length": 64},
            )
        )
    )
    assert (dpo.max_length, dpo.batch, dpo.micro_batch, dpo.sequences_per_micro_batch) == (
        64,
        32,
        8,
        16,
    )
    assert list(plan(dpo).rows) == ["policy"]
    rm, _ = plan_run(str(run_dir(tmp_path, "rm", model_dir)))
    assert rm.actor.n_params == N_SCORE  # the reward model: the backbone under a one-label head


@pytest.mark.parametrize("method", ["ppo", "grpo"])
def test_a_replayed_filter_is_planned_through_the_logits(tmp_path, model_dir, method):
    """rollout.replay_filter with top-p/top-k computes the policy's log-probabilities through the
    logits (the fused path holds no vocabulary row to filter): planned so, with a note; without
    a filter the field changes nothing."""
    replay = {"rollout.replay_filter": True, "rollout.top_p": 0.9}
    got, run = plan_run(str(run_dir(tmp_path / "r", method, model_dir, **replay)))
    assert got.logprobs == "logits"
    assert any("rollout.replay_filter" in n for n in run.notes), run.notes
    plain, run = plan_run(
        str(run_dir(tmp_path / "p", method, model_dir, **{"rollout.replay_filter": True}))
    )
    assert plain.logprobs == "fused" and not any("replay" in n for n in run.notes)


def test_flags_override_the_run_and_a_yaml_file_needs_its_method(tmp_path, model_dir):
    d = run_dir(tmp_path, "sft", model_dir)
    setup, _ = plan_run(str(d), micro_batch=2, gpus=4)
    assert setup.micro_batch == 2 and setup.world == 4 and setup.strategy == "fsdp"
    hand = tmp_path / "sft.yaml"
    hand.write_text(
        f"model:\n  path: {model_dir}\ntrain:\n  batch_size: 4\n  micro_batch_size: 2\n"
    )
    setup, _ = plan_run(str(hand), "sft")
    assert (setup.method, setup.batch, setup.micro_batch, setup.max_length) == ("sft", 4, 2, 512)


@pytest.mark.parametrize(
    "make,argv,message",
    [
        (None, ["--run", "/nonexistent/run.yaml"], "--run /nonexistent/run.yaml: no such file"),
        ("hand", ["--run", "{hand}"], "name it with --method"),
        ("sft", ["--run", "{dir}", "--method", "ppo"], "--method ppo, but the file's sections"),
        ("nomodel", ["--run", "{hand}", "--method", "sft"], "model.path /nonexistent/m: no such"),
        ("badprec", ["--run", "{hand}", "--method", "sft"], "train.precision = 'fp8' is not one"),
        ("badbatch", ["--run", "{hand}", "--method", "sft"], "train.batch_size = 'x' must be"),
        ("norm", ["--run", "{dir}"], "model.critic = reward_model needs model.reward_model"),
        (None, [], "one of the arguments --params --config --run is required"),
    ],
)
def test_run_errors_name_the_problem(tmp_path, model_dir, capsys, make, argv, message):
    hand = tmp_path / "run.yaml"
    d = tmp_path / "none"
    texts = {
        "hand": f"model:\n  path: {model_dir}\n",
        "nomodel": "model:\n  path: /nonexistent/m\n",
        "badprec": f"model:\n  path: {model_dir}\ntrain:\n  precision: fp8\n",
        "badbatch": f"model:\n  path: {model_dir}\ntrain:\n  batch_size: x\n",
    }
    if make in texts:
        hand.write_text(texts[make])
    elif make == "sft":
        d = run_dir(tmp_path, "sft", model_dir)
    elif make == "norm":
        d = run_dir(tmp_path, "ppo", model_dir, **{"model.reward_model": None})
    argv = [a.format(hand=hand, dir=d) for a in argv]
    with pytest.raises(SystemExit) as e:
        memory.cli(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "proximal memory: error:" in err and message in err, err


@pytest.mark.parametrize("method", ["ppo", "grpo", "dpo", "sft", "rm"])
def test_the_cli_plans_a_run(tmp_path, model_dir, capsys, method):
    d = run_dir(tmp_path, method, model_dir)
    assert memory.cli(["--run", str(d), "--units", "MiB"]) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "largest micro-batch that fits this layout" in out
    assert memory.cli(["--run", str(d), "--json", "--gpus", "2"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["method"] == method and j["setup"]["strategy"] == "fsdp"
    assert j["peak_bytes_per_gpu"] == j["static_bytes"] + max(j["phase_bytes"].values())


def test_the_gpu_check_answers_help_on_a_cpu():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory_gpu_check.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--precision" in proc.stdout and "--runs" in proc.stdout


# ---- checked against reality -----------------------------------------------------------------------


def _benchmark():
    spec_ = importlib.util.spec_from_file_location(
        "memory_methods", ROOT / "benchmarks" / "memory_methods.py"
    )
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


MEASURED = ("ppo", "grpo", "rloo", "distill", "distill-jsd", "dpo", "simpo", "sft", "rm")


@pytest.fixture(scope="module")
def measured_runs(tmp_path_factory):
    bench = _benchmark()
    workdir = tmp_path_factory.mktemp("memory_methods")
    bench.prepare(workdir, "test", list(MEASURED))
    return bench, workdir


@pytest.mark.slow
@pytest.mark.parametrize("name", MEASURED)
def test_each_method_within_15_percent_of_its_plan(measured_runs, name):
    """The real trainer (``proximal <command> --config``, float32, one process): the allocator's peak
    over its second step within ±15 % of ``proximal memory --run``'s per-device peak for the same
    file, and so is what the step adds above the weights and AdamW state (docs/memory.md)."""
    bench, workdir = measured_runs
    r = bench.run_one(name, workdir)
    assert abs(r["ratio"] - 1) <= 0.15, r
    assert abs(r["static"] / r["predicted_static"] - 1) <= 0.15, r
    above = (r["peak"] - r["static"]) / (r["predicted"] - r["predicted_static"])
    assert abs(above - 1) <= 0.15, (above, r)


# ----------------------------------------------------------------------------------------------
# A CPU run is planned in host memory (issue 37 item 11)
# ----------------------------------------------------------------------------------------------


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def test_a_cpu_run_is_planned_in_host_memory_against_the_machine_s_ram(tmp_path, model_dir, capsys):
    d = run_dir(tmp_path, "ppo", model_dir, **{"train.device": "cpu"})
    assert memory.cli(["--run", str(d), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    # hidden 64 < 256: train.compile auto compiles nothing; the process's imports are host memory
    assert j["device"] == "cpu" and j["host_bytes"] == {"imports": 434 * 2**20}
    peak = j["static_bytes"] + max(j["phase_bytes"].values()) + 434 * 2**20
    assert j["peak_bytes_per_gpu"] == peak
    assert j["gpu_memory_bytes"] == _meminfo_total() and j["cheapest_fit"] is None
    assert memory.cli(["--run", str(d), "--host-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "per GPU" not in out and "bytes in host memory: a CPU run" in out.splitlines()[0]
    assert f"verdict: FITS in 16.0 GiB of host memory ({100 * peak / 2**34:.0f}% used)" in out
    assert "+ imports 0.424 GiB + the largest phase" in out and "compiled graphs" not in out
    # too little memory: the verdict says by how much, in host memory
    assert memory.cli(["--run", str(d), "--host-memory", "0.25", "--units", "MiB"]) == 0
    out = capsys.readouterr().out
    assert (
        f"verdict: DOES NOT FIT in 256.0 MiB of host memory (needs {peak / 2**28:.1f}x)"
        in out.splitlines()
    )
    # the same run on a GPU (train.device: cuda) is planned per GPU, with no host terms
    gpu = run_dir(tmp_path / "gpu", "ppo", model_dir, **{"train.device": "cuda"})
    assert memory.cli(["--run", str(gpu), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)
    assert g["device"] == "cuda" and g["host_bytes"] == {}
    assert g["peak_bytes_per_gpu"] == peak - 434 * 2**20


@pytest.mark.parametrize(
    ("hidden", "changes", "compiled"),
    [
        (64, {"train.compile": "blocks"}, True),
        (64, {}, False),  # auto: below AUTO_MIN_HIDDEN
        (256, {"train.steps": 1000}, True),  # auto: wide enough, one process, a long run
        (256, {"train.steps": 3}, False),  # auto: a smoke run does not repay compiling
        (256, {"model.lora_r": 8}, False),  # auto: not with LoRA
        (256, {"train.activation_checkpointing": True}, False),
        (256, {"train.compile": "eager"}, False),
    ],
)
def test_a_cpu_plan_counts_the_compiled_graphs_where_the_run_compiles(
    tmp_path, hidden, changes, compiled, capsys
):
    model = tmp_path / "model"
    tiny_config("llama", 100, hidden=hidden, layers=2, heads=4, kv_heads=2).save_pretrained(model)
    d = run_dir(tmp_path, "ppo", model, **{"train.device": "cpu", **changes})
    assert memory.cli(["--run", str(d), "--json", "--host-memory", "8"]) == 0
    j = json.loads(capsys.readouterr().out)
    expected = {"imports": 434 * 2**20} | ({"compiled graphs": 90 * 10**6} if compiled else {})
    assert j["host_bytes"] == expected
    assert j["peak_bytes_per_gpu"] == (
        j["static_bytes"] + max(j["phase_bytes"].values()) + sum(expected.values())
    )
