"""A job's name (Setup.job): the rule both sides check it by, and how operators weigh jobs."""

from __future__ import annotations

import re

MAX_JOB_NAME = 64
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3  # a job's weight (its decode tags grow by cost / weight: kept finite)
_NAME = re.compile(r"[A-Za-z0-9._-]+")


def job_name_error(name: str) -> str | None:
    """Why ``name`` cannot name a job, or None ("" names none)."""
    if name and (len(name) > MAX_JOB_NAME or not _NAME.fullmatch(name)):
        return f"job={name!r}: expected at most {MAX_JOB_NAME} letters, digits, '.', '_' or '-'"
    return None


def parse_weights(text: str) -> dict[str, float]:
    """``"sweep=3,probe=1"`` -> {"sweep": 3.0, "probe": 1.0}; ValueError naming what is wrong."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        error = job_name_error(name) if name else "a job name is empty"
        if not sep or error:
            raise ValueError(f"job_weights: {item!r}: expected NAME=WEIGHT ({error or 'no ='})")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ValueError(
                f"job_weights: {item!r}: the weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}"
            )
        if name in weights:
            raise ValueError(f"job_weights: job {name!r} is weighed twice")
        weights[name] = weight
    return weights
