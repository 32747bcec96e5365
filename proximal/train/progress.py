"""What a run tells the person watching it: the progress bar, the lines it says (printed as
``proximal <command>: <line>``) and notes (``run.log`` only, unless ``output.verbose``), and
``run.log``, which keeps every one of them. :class:`proximal.train.run.Run` holds one.

A line said before the run directory is taken (before :meth:`Progress.open_log`) waits and is
written to ``run.log`` first, under the line that opens the launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

#: The human-readable log of a run: every line a run says (rank 0), each launch's opening line.
RUN_LOG = "run.log"


@dataclass
class Progress:
    """The run's bar and lines, for ``proximal <command>``; ``verbose`` (``output.verbose``): notes
    are printed too."""

    command: str
    verbose: bool = False
    bar: object = None
    log_path: Path | None = None
    pending_log: list[str] = field(default_factory=list)

    def open_log(self, run_dir: Path, resumed_from: Path | None) -> None:
        """Open ``run_dir/run.log`` — appended to when the run resumes from ``resumed_from``, else
        begun afresh — with the launch's line and what was said before."""
        self.log_path = run_dir / RUN_LOG
        with self.log_path.open("a" if resumed_from is not None else "w") as fh:
            fh.write(
                f"--- proximal {self.command}: "
                + (f"resumed from {resumed_from.name}" if resumed_from is not None else "started")
                + f" ({time.strftime('%Y-%m-%d %H:%M:%S')})\n"
                + "".join(f"{line}\n" for line in self.pending_log)
            )
        self.pending_log.clear()

    def open_bar(self, *, total: int, start: int, unit: str) -> None:
        self.bar = tqdm(
            total=total, initial=start, desc=self.command, unit=unit, dynamic_ncols=True
        )

    def say(self, line: str) -> None:
        """Print ``proximal <command>: <line>`` (the caller decides which ranks speak), above the
        progress bar when there is one, and append it to ``run.log`` (once it is open)."""
        text = f"proximal {self.command}: {line}"
        self.append_log(text)
        if self.bar is not None:
            tqdm.write(text)
        else:
            print(text, flush=True)

    def note(self, line: str) -> None:
        """A line for ``run.log`` only, printed as :meth:`say` prints only with ``verbose``: what the
        run chose where the choice changes no result (rank 0's)."""
        if self.verbose:
            self.say(line)
        else:
            self.append_log(f"proximal {self.command}: {line}")

    def append_log(self, text: str) -> None:
        if self.log_path is None:  # said before open_log: written there then
            self.pending_log.append(text)
            return
        try:
            with self.log_path.open("a") as fh:
                fh.write(text + "\n")
        except OSError:  # the log is a record, never a reason to stop a run
            pass

    def advance(self, postfix: dict | None = None) -> None:
        """One step done: the bar moves, showing ``postfix``'s values."""
        if self.bar is None:
            return
        self.bar.update(1)
        if postfix:
            self.bar.set_postfix(
                {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()}
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
