"""Rewards served over HTTP (issue 42, item 4): model.reward_urls and model.reward_judges, against
servers these tests start on 127.0.0.1 — a good one, one slow past its timeout, one that answers HTTP
500 then recovers, ones that break the JSON contract, one that dies mid-run — each failure one line
with its documented exit status; a whole short GRPO run scored by a server equal, bitwise, to the
same function called in-process; and a judge against a fake OpenAI-compatible server (the request
body, the bearer key from the environment, the parse). No request goes anywhere but loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from ppo_support import command_main, frac_a, ppo_main, read_jsonl, tiny_config, without_timing

from proximal.config import ConfigError
from proximal.data.jsonl import write_jsonl
from proximal.rollout.reward_functions import (
    RewardFunctionError,
    RewardServerLost,
    call_reward_functions,
)
from proximal.rollout.reward_http import (
    HttpSettings,
    RewardServer,
    load_served_rewards,
    render_rubric,
    url_name,
)

ROOT = Path(__file__).resolve().parents[2]
#: Tight settings: a request may take 0.2 s, one retry after 10 ms.
FAST = HttpSettings(batch_size=3, concurrency=2, timeout_s=0.2, retries=1, backoff_s=0.01)


def tally(prompts, completions, target, **kwargs):
    """A test reward (``test_http_rewards:tally``): the count of the row's ``target`` character in the
    completion over its length + 1 — fractions whose binary expansions do not end, so a lossy trip
    through JSON would show — and None (does not apply) for an empty completion."""
    return [c.count(t) / (len(c) + 1) if c else None for c, t in zip(completions, target)]


class _Quiet(ThreadingHTTPServer):
    """A server whose handlers run in daemon threads and that prints nothing when a client it was
    slow for has gone (a broken pipe is what the slow server is for)."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        pass


class Server:
    """A loopback HTTP server in a thread; ``answer(handler, body)`` returns ``(status, bytes)`` or
    None to drop the connection unanswered. ``requests`` holds each (path, headers, body) received."""

    def __init__(self, answer, port: int = 0):
        self.answer, self.requests, self.release = answer, [], threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                out = outer.answer(outer, body)
                if out is None:
                    self.close_connection = True
                    return
                status, data = out
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = _Quiet(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def die(self):
        """Stop listening: every later connection is refused."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def close(self):
        self.release.set()
        if self.thread.is_alive():
            self.die()


@pytest.fixture
def serve():
    started = []

    def start(answer, port: int = 0):
        started.append(Server(answer, port))
        return started[-1]

    yield start
    for s in started:
        s.close()


def scores_of(body: dict) -> tuple[int, bytes]:
    """A good reward server: tally of the body, as ``{"scores": [...]}``."""
    out = tally(body["prompts"], body["completions"], **body["columns"])
    return 200, json.dumps({"scores": out}).encode()


PROMPTS = [f"p{i}" for i in range(8)]
COMPLETIONS = ["aab", "", "abcab", "bbbbbbb", "a", "cab", "ba", "abcabcab"]
TARGETS = list("abcbaabc")


def call(server: RewardServer, step: int | None = 4):
    values = {"prompts": PROMPTS, "completions": COMPLETIONS, "target": TARGETS, "step": step}
    scores, scored = call_reward_functions({server.name: server}, values, n=8, step=step)
    return scores[server.name], scored[server.name]


# ----------------------------------------------------------------------------------------------
# A reward server: the contract, batches, retries, each failure
# ----------------------------------------------------------------------------------------------


def test_a_good_server_scores_as_the_function_in_batches(serve):
    """8 completions in batches of 3 (3 + 3 + 2 requests), each body as docs/rewards.md writes it;
    the scores those of the function called here, None (the empty completion) as not scored."""
    server = serve(lambda s, body: scores_of(body))
    scores, scored = call(RewardServer("tally", server.url, FAST))
    expected = tally(PROMPTS, COMPLETIONS, TARGETS)
    assert scored.tolist() == [v is not None for v in expected]
    assert torch.equal(
        scores[scored], torch.tensor([v for v in expected if v is not None], dtype=torch.float32)
    )
    bodies = sorted((b for _, _, b in server.requests), key=lambda b: b["prompts"][0])
    assert [b["prompts"] for b in bodies] == [PROMPTS[0:3], PROMPTS[3:6], PROMPTS[6:8]]
    assert bodies[0] == {
        "prompts": PROMPTS[0:3],
        "completions": COMPLETIONS[0:3],
        "columns": {"target": TARGETS[0:3]},
        "step": 4,
    }
    assert {p for p, _, _ in server.requests} == {"/score"}


def test_a_url_is_named_by_its_fragment_or_host_and_path(serve):
    assert url_name("http://127.0.0.1:8000/score#math") == "math"
    assert url_name("http://127.0.0.1:8000/v1/score") == "127.0.0.1:8000/v1/score"
    server = serve(lambda s, body: scores_of(body))
    out = load_served_rewards([server.url + "#tally"], [], FAST)
    assert list(out) == ["tally"]
    out["tally"](PROMPTS[:1], COMPLETIONS[:1], target=TARGETS[:1])
    assert server.requests[0][0] == "/score"  # the fragment is never sent


def test_a_server_that_answers_500_then_recovers_is_retried(serve):
    """The first two requests get HTTP 500; with two retries each batch is answered, the scores right."""

    def answer(s, body):
        return (500, b"busy") if len(s.requests) <= 2 else scores_of(body)

    server = serve(answer)
    settings = HttpSettings(batch_size=8, concurrency=1, timeout_s=1.0, retries=2, backoff_s=0.01)
    scores, scored = call(RewardServer("tally", server.url, settings))
    assert len(server.requests) == 3
    assert scored.sum() == 7 and scores[0].item() == pytest.approx(2 / 4, abs=0)


def test_a_server_slow_past_its_timeout_is_lost_in_one_line(serve):
    """Each request waits past reward_http_timeout_s (0.2 s): two tries, then RewardServerLost (exit
    status 1) naming the server, the step, the tries and the timeout."""
    server = serve(lambda s, body: (s.release.wait(5), scores_of(body))[1])
    with pytest.raises(RewardServerLost) as e:
        call(RewardServer("tally", server.url, FAST), step=4)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"reward server 'tally' at step 4 is lost: POST {server.url} (batch ")
    assert (
        "failed 2 tries (last: no answer within model.reward_http_timeout_s = 0.2 s); "
        "the run was stopped (exit status 1)" in message
    )


def test_a_refused_connection_is_lost_after_its_retries(serve):
    server = serve(lambda s, body: scores_of(body))
    server.die()
    with pytest.raises(RewardServerLost, match=r"failed 2 tries \(last: connection refused\)"):
        call(RewardServer("tally", server.url, FAST))


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            (200, b'{"scores": [0.5, '),
            "reward server 'tally' at step 4 answered what is not JSON to POST URL (batch 1 of 1): "
            "Expecting value: line 1 column 18 (char 17) in b'{\"scores\": [0.5, '",
        ),
        (
            (200, b'{"scores": [0.5, 0.25]}'),
            "reward server 'tally' at step 4 (batch 1 of 1) answered 2 scores for 8 completions",
        ),
        (
            (200, b'{"scores": [0.5, 1, null, "0.5", 0, 0, 0, 0]}'),
            "reward server 'tally' at step 4 (batch 1 of 1) answered a non-number at position 3: "
            '"0.5" (a number, or null where it does not apply)',
        ),
        (
            (200, b"[0.5]"),
            "reward server 'tally' at step 4 (batch 1 of 1) answered [0.5]; expected "
            '{"scores": [...]} with one number or null per completion',
        ),
        (
            (404, b"no such path"),
            "reward server 'tally' at step 4 answered HTTP 404 Not Found to POST URL (batch 1 of "
            "1): 'no such path'; not retried",
        ),
    ],
    ids=["malformed-json", "wrong-count", "non-number", "no-scores", "http-404"],
)
def test_a_broken_answer_is_one_line_and_not_retried(answer, message, serve):
    server = serve(lambda s, body: answer)
    settings = HttpSettings(batch_size=8, concurrency=1, timeout_s=1.0, retries=3, backoff_s=0.01)
    with pytest.raises(RewardFunctionError) as e:
        call(RewardServer("tally", server.url, settings))
    assert str(e.value).startswith(message.replace("URL", server.url)), str(e.value)
    assert "\n" not in str(e.value) and len(server.requests) == 1


def test_a_column_that_is_not_json_is_one_line(serve):
    server = serve(lambda s, body: scores_of(body))
    with pytest.raises(RewardFunctionError) as e:
        RewardServer("tally", server.url, FAST)(["p"], ["a"], step=1, target=[{1, 2}])
    assert str(e.value) == (
        "reward server 'tally' at step 1: the request cannot be sent as JSON (Object of type set "
        "is not JSON serializable); a column's values must be JSON (strings, numbers, lists, "
        "mappings)"
    )
    assert server.requests == []


# ----------------------------------------------------------------------------------------------
# A judge on an OpenAI-compatible chat endpoint
# ----------------------------------------------------------------------------------------------


def test_a_judge_sends_its_rubric_with_the_key_and_parses_the_score(serve, tmp_path, monkeypatch):
    replies = {"aab": "Good. Score: 3\nOn reflection, Score: 7.5", "ba": "I cannot grade this."}

    def answer(s, body):
        completion = body["messages"][0]["content"].split("|")[1]
        content = replies.get(completion, "Score: 10")
        return 200, json.dumps({"choices": [{"message": {"content": content}}]}).encode()

    server = serve(answer)
    monkeypatch.setenv("JUDGE_KEY", "sk-test-123")
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Q {prompt}|{completion}|want {target}; keep {braces} and {{x}}")
    endpoint = server.url.replace("/score", "/v1")
    judge = {"endpoint": endpoint, "model": "m-1", "rubric": str(rubric)}
    judge |= {"api_key_env": "JUDGE_KEY", "name": "tone", "max_tokens": 32}
    out = load_served_rewards([], [judge], FAST)
    prompts = ["p0", [{"role": "system", "content": "s"}, {"role": "user", "content": "p1"}]]
    completions = ["aab", [{"role": "assistant", "content": "ba"}]]
    values = {"prompts": prompts, "completions": completions, "target": ["a", "b"], "step": 2}
    values["braces"] = ["no", "no"]
    scores, scored = call_reward_functions(out, values, n=2, step=2)
    assert scored["tone"].tolist() == [True, False]  # no "Score: n" in the second reply
    assert scores["tone"][0].item() == 0.75  # the last match, over the scale 10
    bodies = sorted((b for _, _, b in server.requests), key=lambda b: b["messages"][0]["content"])
    assert {p for p, _, _ in server.requests} == {"/v1/chat/completions"}
    assert {h["Authorization"] for _, h, _ in server.requests} == {"Bearer sk-test-123"}
    assert bodies[0] == {
        "model": "m-1",
        "messages": [{"role": "user", "content": "Q p0|aab|want a; keep no and {{x}}"}],
        "temperature": 0.0,
        "max_tokens": 32,
    }
    assert bodies[1]["messages"][0]["content"] == "Q p1|ba|want b; keep no and {{x}}"


def test_a_judges_missing_key_or_rubric_column_is_refused_at_load(tmp_path, monkeypatch):
    from proximal.rollout.reward_functions import reward_argument_problems

    rubric = tmp_path / "rubric.txt"
    rubric.write_text("{prompt} {completion} {solution}")
    judge = {"endpoint": "http://127.0.0.1:9/v1", "model": "m", "rubric": str(rubric)}
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError) as e:
        load_served_rewards([], [{**judge, "api_key_env": "NO_SUCH_KEY"}], FAST)
    assert str(e.value) == (
        "model.reward_judges[0].api_key_env = 'NO_SUCH_KEY': that environment variable is not set "
        "(export it with the API key)"
    )
    with pytest.raises(ConfigError, match=r"^model.reward_judges\[0\].rubric = '.*nope.txt': No "):
        load_served_rewards([], [{**judge, "rubric": str(tmp_path / "nope.txt")}], FAST)
    problems = reward_argument_problems(
        load_served_rewards([], [judge], FAST), ["answer"], "p.jsonl"
    )
    assert problems and problems[0].startswith(
        "reward function 'judge' needs argument 'solution', which is not a column of p.jsonl"
    )


def test_render_rubric_fills_only_the_names_it_is_given():
    assert render_rubric("{a} {b} {{c}} {c}{", {"a": "x", "c": [1]}) == "x {b} {{c}} [1]{"


# ----------------------------------------------------------------------------------------------
# In a run: proximal grpo
# ----------------------------------------------------------------------------------------------


def grpo_run(policy, prompts, run_dir, model: dict, steps: int = 2, save_every: int = 50) -> int:
    """``proximal grpo`` for ``steps`` cheap steps (two prompts, four responses each, at most 8
    tokens) with ``model`` over the reward settings; the exit code."""
    cfg = {
        "model": {"path": str(policy), **model},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": steps, "seed": 0, "device": "cpu", "save_every": save_every},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 8},
    }
    return command_main("grpo", cfg)


@pytest.fixture
def target_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt": "aaa 0", "target": "a"}, {"prompt": "bbb 1", "target": "b"}])
    return path


def test_grpo_scored_by_a_server_equals_the_function_in_process(
    serve, assets, tmp_path, target_prompts, capsys
):
    """Two GRPO steps scored by tally in-process and by a reward server that calls tally: every
    metric (timings aside) and every sample equal, bitwise, score/<name> under each source's name."""
    server = serve(lambda s, body: scores_of(body))
    runs = {}
    for name, model in [
        ("local", {"reward_functions": ["test_http_rewards:tally"]}),
        ("served", {"reward_urls": [server.url + "#tally"], "reward_http_batch_size": 3}),
    ]:
        rc = grpo_run(assets.policy("llama"), target_prompts, tmp_path / name, model)
        assert rc == 0, capsys.readouterr().err
        runs[name] = [read_jsonl(tmp_path / name / f) for f in ("metrics.jsonl", "samples.jsonl")]
    rename = {"score/tally": "score/test_http_rewards:tally"}
    rename["score/tally_count"] = "score/test_http_rewards:tally_count"
    for local, served in zip(*runs.values()):
        served = [{rename.get(k, k): v for k, v in without_timing(r).items()} for r in served]
        assert [without_timing(r) for r in local] == served
    assert len(server.requests) == 2 * 3  # two steps of 8 completions, batches of 3
    assert any(r["score/test_http_rewards:tally"] > 0 for r in runs["local"][1])


def test_grpo_with_a_server_that_dies_mid_run_ends_with_exit_1(
    serve, assets, tmp_path, target_prompts, capsys
):
    """The server answers step 1, then drops the connection and stops listening: the retries meet
    a refused connection, and the run ends with one line and exit status 1 (not 75, the requeue).
    Brought back on its port, the run resumes from step 1's checkpoint with more retries and a
    longer reward_timeout_s (how a reward is fetched may change on --resume; the models may not)."""

    def answer(s, body):
        if body["step"] == 1:
            return scores_of(body)
        threading.Thread(target=s.die).start()
        return None

    server = serve(answer)
    model = {"reward_urls": [server.url], "reward_http_retries": 2}
    model |= {"reward_http_timeout_s": 0.5, "reward_http_backoff_s": 0.05}
    run = tmp_path / "run"
    rc = grpo_run(assets.policy("llama"), target_prompts, run, model, save_every=1)
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [line for line in err.splitlines() if line.startswith("proximal grpo:")]
    name = server.url.removeprefix("http://")
    assert lines == [
        f"proximal grpo: reward server {name!r} at step 2 is lost: POST {server.url} (batch 1 of "
        f"1) failed 3 tries (last: connection refused); the run was stopped (exit status 1). Bring "
        "the server back (or raise model.reward_http_retries / reward_http_timeout_s), then resume "
        "from the last checkpoint"
    ], err
    assert "Traceback" not in err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]

    back = serve(lambda s, body: scores_of(body), port=server.httpd.server_port)
    more = ["--model.reward_http_retries", "5", "--model.reward_timeout_s", "300"]
    assert command_main("grpo", None, "--resume", str(run), *more) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert [b["step"] for _, _, b in back.requests] == [2]


def test_ppo_weighs_a_server_after_the_functions(serve, assets, tmp_path, capsys):
    """One PPO step with frac_a in-process at weight 0 and a server answering 2 × frac_a at weight 1
    (functions first, then URLs, in model.reward_function_weights): each sample's score is the
    server's, twice the function's, and both are logged under their names."""

    def answer(s, body):
        return 200, json.dumps(
            {
                "scores": [
                    2 * v
                    for v in frac_a(
                        **body["columns"], prompts=body["prompts"], completions=body["completions"]
                    )
                ]
            }
        ).encode()

    server = serve(answer)
    cfg = tiny_config(assets.policy("llama"), assets.prompts, tmp_path / "run")
    cfg["model"] |= {"reward_urls": [server.url + "#double"], "reward_function_weights": [0.0, 1.0]}
    cfg["train"]["steps"] = 1
    assert ppo_main(cfg) == 0, capsys.readouterr().err
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert samples and all(
        r["score"] == r["score/double"] == 2 * r["score/ppo_support:frac_a"] for r in samples
    )
    (metrics,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert metrics["score/double"] == pytest.approx(
        2 * metrics["score/ppo_support:frac_a"], rel=1e-6
    )
    assert metrics["score/double_count"] == 4


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"reward_urls": ["ftp://h/x"]},
            "model.reward_urls[0] = 'ftp://h/x': expected http://host[:port]/path (or https)",
        ),
        (
            {"reward_urls": ["http://127.0.0.1:9/a"], "reward_function_weights": [1.0]},
            "model.reward_function_weights has 1 values for 1 model.reward_functions + 1 "
            "model.reward_urls + 0 model.reward_judges (in that order)",
        ),
        (
            {"reward_judges": [{"endpoint": "http://127.0.0.1:9/v1", "model": "m"}]},
            "model.reward_judges[0]: 'rubric' missing (needs endpoint, model, rubric)",
        ),
        (
            {
                "reward_judges": [
                    {
                        "endpoint": "http://h/v1",
                        "model": "m",
                        "rubric": "r",
                        "score_pattern": "Score: \\d+",
                    }
                ]
            },
            "model.reward_judges[0].score_pattern = 'Score: \\\\d+' has 0 groups: give exactly one",
        ),
        (
            {
                "reward_judges": [
                    {
                        "endpoint": "http://h/v1",
                        "model": "m",
                        "rubric": "r",
                        "api_key_env": "sk-123",
                    }
                ]
            },
            "model.reward_judges[0].api_key_env = 'sk-123': the NAME of an environment variable",
        ),
        (
            {"reward_urls": ["http://127.0.0.1:9/a#x", "http://127.0.0.1:9/b#x"]},
            "two reward sources are named 'x'",
        ),
        ({"reward_http_retries": -1}, "model.reward_http_retries = -1 must be ≥ 0"),
    ],
    ids=["scheme", "weights", "judge-key", "pattern", "api-key", "names", "retries"],
)
def test_grpo_refuses_bad_served_rewards_in_one_line_before_any_model(
    model, message, assets, tmp_path, monkeypatch, capsys
):
    from proximal.trainers import grpo

    def forbidden(*a, **kw):
        raise AssertionError("models were loaded before the config error was reported")

    monkeypatch.setattr(grpo, "build_models", forbidden)
    model = {"reward_functions": ["ppo_support:frac_a"], **model}
    rc = grpo_run(assets.policy("llama"), assets.prompts, tmp_path / "run", model)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err, err
    assert "Traceback" not in err and err.count("proximal grpo:") == 1, err


def test_the_whole_call_counts_against_reward_timeout_s(serve):
    """Three batches of 0.3 s each, one at a time, under a 0.5 s model.reward_timeout_s: the watchdog
    ends the process with its one line, exit status 1, though no request outlived its own timeout."""
    server = serve(lambda s, body: (s.release.wait(0.3), scores_of(body))[1])
    script = f"""
from proximal.rollout.reward_http import HttpSettings, RewardServer
from proximal.rollout.reward_functions import call_reward_functions
s = RewardServer("tally", {server.url!r}, HttpSettings(batch_size=1, concurrency=1, timeout_s=5))
call_reward_functions({{"tally": s}}, {{"prompts": ["p"] * 3, "completions": ["a"] * 3,
                      "target": ["a"] * 3}}, n=3, step=1, timeout_s=0.5)
print("returned")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 1, out.stderr
    assert "returned" not in out.stdout
    assert out.stderr.strip() == (
        "proximal: reward function 'tally' at step 1 did not return within "
        "model.reward_timeout_s = 0.5 s; the run was stopped (exit status 1). Fix the function or "
        "raise the limit (null: none), then resume from the last checkpoint"
    )
