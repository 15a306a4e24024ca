"""The zoo's table (one row per case and config, then the totals per config) and each rule's record on it."""

from __future__ import annotations

import platform


def label(result) -> str:
    """The case, with Keras' backend where it is not TensorFlow."""
    backend = result.backend if result.backend not in ("", "tensorflow") else ""
    return result.case.id + (f" ({backend})" if backend else "")


def table(results) -> str:
    lines = ["# tripwire zoo", "",
             f"Python {platform.python_version()}, {platform.machine()}. A verdict counts at severity warning or "
             "error; info verdicts are listed apart. A fault must be caught with every rule on (`all_rules`, sampled "
             "every 10 steps); what the default config (sampled every 100) catches is shown.", "",
             "| case | fault | config | learned | fired (warning/error) | info | right rule | onset→verdict "
             "| primary cause | names the fault |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        info = ", ".join(dict.fromkeys(v.rule for v in r.quiet if v.fired)) or "-"
        right = "yes" if r.right_rule else ("NO" if r.expected else "-")
        delay = "-" if r.delay is None else str(r.delay)
        primary = f"{r.primary.rule} @{r.primary.began}" if r.primary is not None else "-"
        names = "-" if r.case.healthy else ("yes" if r.names_fault else "no")
        lines.append(f"| {label(r)} | {r.case.fault or 'healthy'} | {r.config} | {r.score} | "
                     f"{', '.join(r.rules) or '-'} | {info} | {right} | {delay} | {primary} | {names} |")
    lines += ["", "| config | healthy runs | false-alarm runs | healthy runs stopped | faulty runs | caught | "
                  "by the right rule | primary cause names the fault |", "|---|---|---|---|---|---|---|---|"]
    for config in dict.fromkeys(r.config for r in results):
        mine = [r for r in results if r.config == config]
        healthy = [r for r in mine if r.case.healthy]
        faulty = [r for r in mine if not r.case.healthy]
        lines.append(f"| {config} | {len(healthy)} | {sum(r.false_alarm for r in healthy)} | "
                     f"{sum(r.status == 'stopped' for r in healthy)} | {len(faulty)} | "
                     f"{sum(r.caught for r in faulty)} | {sum(r.right_rule for r in faulty)} | "
                     f"{sum(r.names_fault for r in faulty)} |")
    silent = [r for r in results if "silent" in r.case.tags]
    if silent:
        lines += ["", "Silent bugs (tagged `silent`: the run trains and no number goes bad): caught within one step "
                      "of the step the bug first acts (onset→verdict at most 1).", "",
                  "| config | silent bugs | caught | by the right rule | within one step | primary cause names the "
                  "bug |", "|---|---|---|---|---|---|"]
        for config in dict.fromkeys(r.config for r in silent):
            mine = [r for r in silent if r.config == config]
            lines.append(f"| {config} | {len(mine)} | {sum(r.caught for r in mine)} | "
                         f"{sum(r.right_rule for r in mine)} | "
                         f"{sum(r.right_rule and r.delay is not None and r.delay <= 1 for r in mine)} | "
                         f"{sum(r.names_fault for r in mine)} |")
    return "\n".join(lines)


def by_rule(results) -> dict:
    """Each rule's record over the zoo, with every rule on: healthy runs it fired on at warning or error, the faults
    it is named for, those it fired on (at warning or error, or at info as the primary cause of a diagnosis that
    counts), those no rule named for them caught, and the faults it fired on that only other rules are named
    for."""
    mine = [r for r in results if r.config == "all_rules"]
    healthy = [r for r in mine if r.case.healthy]
    record: dict = {}
    for rule in sorted({rule for r in mine for rule in r.enabled}):
        entry = record[rule] = {"healthy_runs": len(healthy), "false_alarms": [], "named": [], "fired": [],
                                "missed": [], "also_fired_on": []}
        for r in mine:
            fired = rule in {found for found, _ in r.detections}  # a risk at info counts where it leads a warning
            if r.case.healthy and fired:
                entry["false_alarms"].append(label(r))
            elif not r.case.healthy and rule in r.case.catch:
                entry["named"].append(label(r))
                if fired:
                    entry["fired"].append(label(r))
                elif not r.right_rule:  # no rule named for the fault caught it
                    entry["missed"].append(label(r))
            elif not r.case.healthy and fired:
                entry["also_fired_on"].append(label(r))
    return {"runs": len(mine), "healthy_runs": len(healthy), "rules": record}
