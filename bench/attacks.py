"""The attack suite (chaos.attacks): each listener finding of issue 33 against a real router and
control plane, while a well-behaved neighbour is timed and the target's RSS is watched.

    python -m bench.attacks [--long] [--only NAME ...] [--work-dir DIR]

Short form (the default, what CI runs): a few seconds an attack, ~70 s in all on two cores.
Long form (`--long`): the issue's sizes (hundreds of thousands of requests, tens of seconds).
Each attack starts a fresh control plane and router (chaos.attacks.target); `--only` takes
attack names (`pipelining`, `ws_warmups`, `ws_revoked_key`, `h2_settings_flood`,
`h2_endless_bodies`) or `name-target` (`pipelining-control-plane`).

Prints a table on stdout (per attack: bytes sent, when it was cut off, the neighbour's p50
and p99 during it with its idle figures, RSS idle/peak/after, and every bound broken, as
chaos.attacks.check says), then one JSON line per figure (bench `attacks`), metrics
`<attack>_<target>_<figure>`:
  bytes_sent          bytes the server took (baseline 0: none);
  cut_off             1 when the server cut the attack off, 0 when it never did (goal 1);
  cut_off_s           seconds until it did, or the attack's whole run when it never did
                      (baseline: the bound);
  neighbour_p50_ms,   the neighbour during the attack (baseline: the same neighbour alone
  neighbour_p99_ms    just before it; the goal for p99 is the bound);
  rss_peak_mib,       the target's RSS at its peak during the attack and after it (baseline:
  rss_after_mib       idle; the goals are the bounds above idle).
The exit status is 0 whatever the checks say (a benchmark reports; tests/e2e/test_attacks.py
asserts).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from bench.common import Figure
from chaos.attacks import ATTACKS, FORMS, SHORT, AttackResult, Form, check, run_suite, table

BENCH = "attacks"


def figures(r: AttackResult) -> list[Figure]:
    o, b, p = r.outcome, r.bounds, f"{r.attack}_{r.target.replace('-', '_')}_"
    cut = o.cut_off_s if o.cut_off_s is not None else o.ran_s
    return [
        Figure(BENCH, p + "bytes_sent", o.bytes_sent, 0, "none", "reported (bounded by the attack's budget)", "bytes"),
        Figure(BENCH, p + "cut_off", float(o.cut_off_s is not None), 1, "goal", "ours = 1 (the server cut it off)",
               "bool"),
        Figure(BENCH, p + "cut_off_s", cut, b.cut_off_s, "bound", f"ours <= {b.cut_off_s:g} s and cut_off = 1", "s"),
        Figure(BENCH, p + "neighbour_p50_ms", r.neighbour_p50_ms, r.idle_p50_ms, "neighbour alone before the attack",
               "reported", "ms"),
        Figure(BENCH, p + "neighbour_p99_ms", r.neighbour_p99_ms, r.idle_p99_ms, "neighbour alone before the attack",
               f"ours <= {b.neighbour_p99_ms:g} ms", "ms"),
        Figure(BENCH, p + "rss_peak_mib", r.rss_peak_mib, r.rss_idle_mib, "idle RSS",
               f"ours - baseline <= {b.rss_peak_mib:g} MiB", "MiB"),
        Figure(BENCH, p + "rss_after_mib", r.rss_after_mib, r.rss_idle_mib, "idle RSS",
               f"ours - baseline <= {b.rss_after_mib:g} MiB", "MiB"),
    ]


def run(form: Form = SHORT, only: tuple[str, ...] = (), work_dir: Path | None = None) -> list[AttackResult]:
    """Run the attacks (those named in `only`, else all) in `form`; their results."""
    attacks = [a for a in ATTACKS if not only or a.name in only or f"{a.name}-{a.target}" in only]
    if not attacks:
        raise SystemExit(f"no attack named {', '.join(only)}")
    if work_dir is not None:
        return asyncio.run(run_suite(attacks, form, work_dir))
    with tempfile.TemporaryDirectory(prefix="meridian-attacks-") as tmp:
        return asyncio.run(run_suite(attacks, form, Path(tmp)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="the issue's sizes instead of CI's short form")
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME", help="attack names (or name-target)")
    ap.add_argument("--work-dir", type=Path, default=None, help="keep the fabrics' logs here")
    args = ap.parse_args()
    results = run(FORMS["long" if args.long else "short"], tuple(args.only), args.work_dir)
    print(table(results), flush=True)
    for r in results:
        for fig in figures(r):
            print(fig.json_line(), flush=True)
    broke = sum(bool(check(r)) for r in results)
    print(f"# {broke} of {len(results)} attacks broke a bound", file=sys.stderr)


if __name__ == "__main__":
    main()
