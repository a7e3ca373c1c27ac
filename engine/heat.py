"""The expert heat histogram: tokens routed to each (layer, expert), and its JSON file form
`{"<layer>": {"<expert>": count, ...}, ...}` that `shoal heat --json` writes and
`shoal plan --heat` reads."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from engine.errors import CorruptData, InvalidInput, NotFound

ExpertKey = tuple[int, int]


def heat_to_json(heat: Mapping[ExpertKey, float]) -> dict[str, dict[str, float]]:
    body: dict[str, dict[str, float]] = {}
    for (layer, expert), count in sorted(heat.items()):
        body.setdefault(str(layer), {})[str(expert)] = count
    return body


def heat_from_json(body: object, *, origin: str) -> dict[ExpertKey, float]:
    if not isinstance(body, dict):
        raise InvalidInput(f"{origin}: expected {{\"<layer>\": {{\"<expert>\": count}}}}")
    heat: dict[ExpertKey, float] = {}
    for layer, experts in body.items():
        if not isinstance(experts, dict):
            raise InvalidInput(f"{origin}: layer {layer!r} must map expert ids to counts")
        for expert, count in experts.items():
            try:
                key = (int(layer), int(expert))
            except ValueError:
                bad = f"{layer!r}/{expert!r}"
                raise InvalidInput(f"{origin}: {bad} is not a layer/expert id") from None
            if not isinstance(count, int | float) or count < 0:
                raise InvalidInput(f"{origin}: count of {key[0]}/{key[1]} must be a number >= 0")
            heat[key] = float(count)
    return heat


def read_heat(path: Path) -> dict[ExpertKey, float]:
    try:
        body = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise NotFound(f"heat file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise CorruptData(f"heat file {path} is not valid JSON ({e})") from None
    return heat_from_json(body, origin=str(path))


def check_heat_matches(heat: Mapping[ExpertKey, float], experts: Mapping[ExpertKey, int]) -> None:
    unknown = sorted(set(heat) - set(experts))
    if unknown:
        layer, expert = unknown[0]
        raise InvalidInput(
            f"the heat names {len(unknown)} expert(s) this model does not have, e.g. "
            f"layer {layer} expert {expert}: is it from another model?"
        )
