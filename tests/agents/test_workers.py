"""Worker processes own their descendants and die with their trainer: a timeout kills a tool's
children, ``close()`` reaps everything, a SIGKILLed trainer leaves no worker behind (its pool
started from the main thread or another one), and a job's time limit starts when its worker is
ready. Each test looks for survivors in /proc and kills whatever it started, pass or fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import agent_support as S
import pytest

from proximal.agents import worker as W
from proximal.agents.worker import Job, WorkerPool

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its new parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def read_pid(path: Path, seconds: float = 20.0) -> int:
    end = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > end:
            raise AssertionError(f"{path} was never written")
        time.sleep(0.02)
    return int(path.read_text())


def kill(*pids: int | None) -> None:
    for pid in pids:
        if pid is not None and alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_timeout_kills_the_tools_children(tmp_path):
    """Fault 1: a tool starts ``sleep 1234`` and hangs; the timeout used to kill the worker only."""
    pid_file, child, worker = tmp_path / "child", None, None
    try:
        with WorkerPool(1, timeout_s=1.0) as pool:
            pool.start()
            worker = pool._workers[0].process.pid
            (out,) = pool.run([Job(0, ("call", S.spawn, (str(pid_file),), {}))])
            child = read_pid(pid_file)
            assert out[0] == "timeout"
            assert gone_within(child, 2.0), f"the tool's child {child} outlived the timeout"
            assert not alive(worker)
    finally:
        kill(child, worker)


def test_close_reaps_every_process_a_tool_started(tmp_path):
    pid_file, child, worker = tmp_path / "child", None, None
    try:
        pool = WorkerPool(1, timeout_s=10.0)
        (out,) = pool.run([Job(0, ("call", S.spawn, (str(pid_file), False), {}))])
        child, worker = int(out[1]), pool._workers[0].process.pid
        assert out[0] == "ok" and alive(child)
        pool.close()
        assert gone_within(child, 2.0), f"the tool's child {child} outlived close()"
        assert not alive(worker)
    finally:
        kill(child, worker)


TRAINER = textwrap.dedent(
    """
    import sys, threading
    import agent_support as S
    from proximal.agents.worker import Job, WorkerPool

    pool = WorkerPool(1, timeout_s=None)
    if sys.argv[1] == "thread":  # started by a thread that ends before the call
        t = threading.Thread(target=pool.start)
        t.start()
        t.join()
    else:
        pool.start()
    assert pool.run([Job(0, ("call", S.add, (1, 2), {}))]) == [("ok", "3")]
    if sys.argv[1] == "forked":  # a child forked without exec lives on after the trainer
        import os, time
        if os.fork() == 0:
            open(sys.argv[2] + ".forked", "w").write(str(os.getpid()))
            time.sleep(30)
            os._exit(0)
    print(pool._workers[0].process.pid, flush=True)
    pool.run([Job(0, ("call", S.spawn, (sys.argv[2],), {}))])  # hangs
    """
)


@pytest.mark.parametrize("started_by", ["main", "thread", "forked"])
def test_a_killed_trainer_leaves_no_worker(tmp_path, started_by):
    """Fault 2: the trainer SIGKILLed while a tool call hangs; its worker used to live on under
    init, and with it the ``sleep`` its tool started. From another thread, PR_SET_PDEATHSIG would
    kill the worker when that thread ends (the call after it must still work), so it is not set
    there. ``forked``: the trainer has forked a child that outlives it, which must not hold the
    guardians' pipe open (the tool's ``sleep`` lived on while that child did)."""
    script, pid_file = tmp_path / "trainer.py", tmp_path / "child"
    script.write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    trainer = subprocess.Popen(
        [sys.executable, str(script), started_by, str(pid_file)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    worker = child = None
    try:
        line = trainer.stdout.readline()
        assert line.strip().isdigit(), f"the trainer failed: {line!r}"
        worker = int(line)
        child = read_pid(pid_file)
        assert alive(worker) and alive(child)
        trainer.kill()
        trainer.wait(timeout=5)
        assert gone_within(worker, 3.0), f"worker {worker} outlived its SIGKILLed trainer"
        assert gone_within(child, 3.0), f"the tool's child {child} outlived the trainer"
    finally:
        trainer.kill()
        trainer.wait(timeout=5)
        forked = Path(f"{pid_file}.forked")
        kill(worker, child, int(forked.read_text()) if forked.exists() else None)


def test_a_jobs_time_starts_when_its_worker_is_ready(monkeypatch):
    """A worker slow to start (1.5 s here, an interpreter under load in CI) is not charged to the
    job it was started for: the limit (1 s) counts from its first message. Before, the deadline was
    set when the job was sent, and a fast call timed out."""
    command = W._command

    def slow(*args):
        argv = command(*args)
        return [*argv[:2], "import time; time.sleep(1.5); " + argv[2]]

    monkeypatch.setattr(W, "_command", slow)
    with WorkerPool(1, timeout_s=1.0) as pool:
        assert pool.run([Job(0, ("call", S.add, (1, 2), {}))]) == [("ok", "3")]
        # a replacement after a timeout starts as slowly, and the next call still fits
        out = pool.run([Job(0, ("call", S.hang, (1,), {})), Job(0, ("call", S.add, (2, 2), {}))])
        assert out[0][0] == "timeout" and out[1] == ("ok", "4")


def test_a_tools_prints_go_to_the_log_capped(tmp_path, monkeypatch, capfd):
    """Fault 7: a chatty tool's prints went to the trainer's stdout. Now to the log, at most
    LOG_CAP bytes and one line saying the rest was dropped."""
    command = W._command
    monkeypatch.setattr(
        W,
        "_command",
        lambda *a: [
            *command(*a)[:2],
            "import proximal.agents.worker as W; W.LOG_CAP = 1000; " + command(*a)[2],
        ],
    )
    log = tmp_path / "tools.log"
    with WorkerPool(1, timeout_s=10.0, log=str(log)) as pool:
        assert pool.run([Job(0, ("call", S.chatty, (300,), {}))]) == [("ok", "300")]
        assert pool.run([Job(0, ("call", S.chatty, (600,), {}))]) == [("ok", "600")]
    text = log.read_text()
    assert text.startswith("o" * 300 + "e" * 300)
    assert len(text.splitlines()[0]) == 1000  # the cap, then the line saying so
    assert "1000 bytes reached" in text
    out, err = capfd.readouterr()
    assert "ooo" not in out and "eee" not in err


def test_a_checkout_in_the_working_directory_does_not_stand_in_for_the_trainers(
    tmp_path, monkeypatch
):
    """``python -c`` puts the working directory first on the import path: a worker started where
    another proximal lies (a checkout, a stray package) imported that one instead of the trainer's.
    The worker's path is the parent's."""
    fake = tmp_path / "proximal"
    (fake / "agents").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "agents" / "__init__.py").write_text("")
    (fake / "agents" / "worker.py").write_text("raise SystemExit('the wrong proximal')\n")
    monkeypatch.chdir(tmp_path)
    with WorkerPool(1, timeout_s=10.0) as pool:
        assert pool.run([Job(0, ("call", S.add, (1, 2), {}))]) == [("ok", "3")]
