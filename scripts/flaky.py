"""``make flaky``: the whole suite N times in a row, under CPU load; every test that failed at least once.

    make flaky                   5 runs, with a busy loop on every core
    make flaky RUNS=10 LOAD=0    10 runs, no load

Each run is the two pytest passes of ``make test`` (``make test-postgres``, ``test-sqlite``), each with a JUnit
report. Everything is kept in ``test-artifacts/flaky/<start time>/``:
``run-<n>-<pass>.log`` (the whole output) and ``.xml``, and ``run-<n>-failures/`` (the worker, beat and
watchdog logs of each failed test, which the suite saves in ``test-artifacts/failures/``). At the end it lists
every test that failed at least once, in how many runs, and the first lines of its first failure; the exit
status is 1 if there was one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSES = ("postgres", "sqlite")
FAILURES = ROOT / "test-artifacts" / "failures"


@dataclass
class Failed:
    """A test that failed in one run or more."""

    runs: list[str] = field(default_factory=list)
    first: str = ""


@contextmanager
def cpu_load(cores: int) -> Iterator[None]:
    """A busy loop on each of ``cores`` cores (nothing when 0), for as long as the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def run_pass(name: str, run: int, out: Path) -> tuple[int, float]:
    """One pass of the suite; (exit status, seconds). Stopped (Ctrl-C, SIGTERM), it stops the whole pass with
    it: a pass left running would drop the test database under the next hunt's feet."""
    report = out / f"run-{run}-{name}.xml"
    started = time.monotonic()
    with (out / f"run-{run}-{name}.log").open("wb") as log:
        make = subprocess.Popen(
            ["make", "--no-print-directory", f"test-{name}", f"PYTEST_ARGS=--junitxml={report} -p no:cacheprovider"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            status = make.wait()
        finally:
            if make.poll() is None:
                os.killpg(make.pid, signal.SIGTERM)
                make.wait()
    return status, time.monotonic() - started


def failures_in(report: Path) -> Iterator[tuple[str, str]]:
    """(test id, failure text) of each failed or erroring test case of a JUnit report."""
    if not report.exists():
        yield f"{report.name}: no report (the pass did not finish)", ""
        return
    for case in ET.parse(report).getroot().iter("testcase"):
        for problem in (*case.findall("failure"), *case.findall("error")):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            yield test, (problem.get("message") or "") + "\n" + (problem.text or "")


def _interrupted(*_: object) -> None:
    """SIGTERM as Ctrl-C: the pass and the busy loops under way are stopped on the way out."""
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="how many times to run the suite (default 5)")
    parser.add_argument(
        "--load", type=int, default=os.cpu_count() or 1, help="busy loops to run meanwhile (default: one per core)"
    )
    args = parser.parse_args()
    out = ROOT / "test-artifacts" / "flaky" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    print(f"flaky: {args.runs} run(s) of the suite, {args.load} busy loop(s) alongside; output in {out}", flush=True)
    failed: dict[str, Failed] = {}
    for run in range(1, args.runs + 1):
        shutil.rmtree(FAILURES, ignore_errors=True)
        with cpu_load(args.load):
            for name in PASSES:
                status, seconds = run_pass(name, run, out)
                found = list(failures_in(out / f"run-{run}-{name}.xml"))
                print(f"flaky: run {run} {name}: exit {status}, {seconds:.0f} s, {len(found)} failed", flush=True)
                if status != 0 and not found:
                    found = [(f"run {run} {name}: exit {status} with no failed test (see its log)", "")]
                for test, text in found:
                    entry = failed.setdefault(test, Failed(first=text))
                    entry.runs.append(f"{run}/{name}")
        if FAILURES.exists():
            shutil.copytree(FAILURES, out / f"run-{run}-failures")
    lines = [f"# make flaky: {args.runs} run(s), load {args.load}", ""]
    if not failed:
        lines.append("No test failed.")
    for test, entry in sorted(failed.items(), key=lambda item: -len(item[1].runs)):
        lines += [f"## {test}", f"failed in {len(entry.runs)} run(s): {', '.join(entry.runs)}", ""]
        lines += ["    " + line for line in entry.first.strip().splitlines()[:25]] + [""]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"flaky: logs, reports and the failed tests' process logs are in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
