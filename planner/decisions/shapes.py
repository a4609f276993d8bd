"""Do the campaign's shape and its runs' agree? For an image, seq_len is positions per example (H×W).

A run of the user's own loop records what its model was called with, read by role (planner/shapes.py). Where
those positions are fixed by the data (an image's H×W, a feature vector's one), a campaign's seq_len that no run
read is a spec written in other units (the image side, 32, for 32×32 images): planning it would move the need
along a line through one point to a size nobody measured, so plan stops and says what to write.
"""

from __future__ import annotations

import pandas as pd

from planner.errors import CampaignError
from planner.inputs.campaign_spec import Campaign
from planner.shapes import FIXED, InputShape, parse_shape


def read_shapes(lines: pd.DataFrame, eval_phase: bool) -> list[InputShape]:
    """The shapes the lines' runs read (eval lines hold eval's), newest first; [] where no line says."""
    if "input_shape" not in lines:
        return []
    mine = lines[(lines["phase"] == "eval") == eval_phase]
    order = mine["seq"] if "seq" in mine else pd.Series(range(len(mine)), index=mine.index)
    shapes = [parse_shape(t) for t in mine.assign(_o=order).sort_values("_o", ascending=False)["input_shape"]]
    return list(dict.fromkeys(s for s in shapes if s is not None))


def input_kind(lines: pd.DataFrame) -> str:
    """What the family's model takes, as its newest run read it ('' where no line says: rentplan's own probes
    and older ledgers)."""
    shapes = read_shapes(lines, eval_phase=False)
    return shapes[0].kind if shapes else ""


def input_kind_of(sheet: pd.DataFrame) -> str:
    """What a sheet's campaign model takes (one kind per sheet: one campaign); '' where its lines do not say."""
    kinds = sheet["input_kind"].dropna() if "input_kind" in sheet else pd.Series([], dtype=object)
    return str(kinds.iloc[0]) if len(kinds) else ""


def agreeing_shape(campaign: Campaign, lines: pd.DataFrame) -> InputShape | None:
    """The read shape the campaign's training is planned at (None where nothing was read, or the kind has a
    sequence to extrapolate along); CampaignError naming both sides where a fixed kind's positions disagree."""
    train, evals = read_shapes(lines, False), read_shapes(lines, True) or read_shapes(lines, False)
    if not train or train[0].kind not in FIXED:
        return None
    problems = []
    for label, wanted, shapes, where in (("seq_len", campaign.seq_len, train, ""),
                                         ("eval's seq_len", campaign.eval.seq_len, evals, " under eval")):
        read = [s for s in shapes if s.kind in FIXED]
        if wanted is None or not read or any(s.positions == wanted for s in read):
            continue
        shown = "; ".join(f"{s.text}: {s.positions_text} per example" for s in read[:3])
        problems.append(f"{label} {wanted} matches no shape they read ({shown}): write "
                        f"`seq_len: {read[0].positions}`{where}")
    if problems:
        rule = ("For an image, seq_len counts positions per example (H×W; D×H×W for a volume), not its side nor its "
                "channels" if train[0].kind == "image" else "A feature vector has one position per example")
        raise CampaignError(f"{campaign.source or 'the campaign'} does not match the runs of {campaign.workload}: "
                            + "; ".join(problems) + f". {rule}. Or run your loop at the size you will train, then "
                            "plan again.")
    return next((s for s in train if s.positions == (campaign.seq_len or s.positions)), train[0])
