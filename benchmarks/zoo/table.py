"""The zoo's table: one row per case and config, then the totals per config."""

from __future__ import annotations

import platform


def table(results, backend: str | None = None) -> str:
    lines = [f"# tripwire zoo{f' (Keras on {backend})' if backend else ''}", "",
             f"Python {platform.python_version()}, {platform.machine()}. A verdict counts at severity warning or "
             "error; info verdicts are listed apart.", "",
             "| case | fault | config | learned | fired (warning/error) | info | right rule | onset→verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        info = ", ".join(dict.fromkeys(v.rule for v in r.quiet if v.fired)) or "-"
        right = "yes" if r.right_rule else ("NO" if r.expected else "-")
        delay = "-" if r.delay is None else str(r.delay)
        lines.append(f"| {r.case.id} | {r.case.fault or 'healthy'} | {r.config} | {r.score} | "
                     f"{', '.join(r.rules) or '-'} | {info} | {right} | {delay} |")
    lines += ["", "| config | healthy runs | false-alarm runs | healthy runs stopped | faulty runs | caught | "
                  "by the right rule |", "|---|---|---|---|---|---|---|"]
    for config in dict.fromkeys(r.config for r in results):
        mine = [r for r in results if r.config == config]
        healthy = [r for r in mine if r.case.healthy]
        faulty = [r for r in mine if not r.case.healthy]
        lines.append(f"| {config} | {len(healthy)} | {sum(r.false_alarm for r in healthy)} | "
                     f"{sum(r.status == 'stopped' for r in healthy)} | {len(faulty)} | "
                     f"{sum(r.caught for r in faulty)} | {sum(r.right_rule for r in faulty)} of "
                     f"{sum(r.expected for r in faulty)} with the rule on |")
    return "\n".join(lines)
