# SPDX-License-Identifier: Apache-2.0
"""bridge/_native/block.h, the protocol of a block's life, names what the code has.

Its banner lists each state of a block and the functions, locks and figures that move it;
these tests fail when a name it cites leaves the code (a rename, a removal), when a
record flag is defined anywhere else, or when a state it lists is never reached by a
transition.  wait.c's states are named in its code and its banner alike.
"""

from __future__ import annotations

import pathlib
import re

NATIVE = pathlib.Path(__file__).resolve().parents[2] / "bridge" / "_native"
BLOCK_H = NATIVE / "block.h"


def _banner() -> str:
    text = BLOCK_H.read_text()
    return text[: text.index("#ifndef BRIDGE_BLOCK_H")]


def _code_without(*skip: str) -> str:
    return "\n".join(p.read_text() for p in sorted(NATIVE.glob("*.[ch]")) if p.name not in skip)


def test_every_name_the_banner_cites_is_in_the_code():
    # identifiers with an underscore: functions, fields, locks, figures
    cited = set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", _banner()))
    assert len(cited) > 60, sorted(cited)  # the banner cites the code it describes
    code = _code_without("block.h")
    missing = sorted(n for n in cited if not re.search(rf"\b{n}\b", code))
    assert not missing, f"block.h cites names the code no longer has: {missing}"


def test_record_flags_are_defined_in_block_h_alone():
    flags = re.findall(r"^#define (REC_[A-Z_]+)\s", BLOCK_H.read_text(), re.M)
    assert flags == ["REC_GRAPH", "REC_USER_FREED", "REC_CARVED", "REC_UNORDERED"]
    elsewhere = re.findall(r"^#define REC_", _code_without("block.h"), re.M)
    assert not elsewhere
    assert '#include "block.h"' in (NATIVE / "records.h").read_text()


def test_every_state_is_entered_and_left_by_a_transition():
    banner = _banner()
    states_part = banner[banner.index(" * States (") : banner.index(" * Transitions (")]
    states = re.findall(r"^ \*   {1,3}([A-Z][A-Z_]+) ", states_part, re.M)
    assert {"LIVE", "PARKED", "CACHED", "CARVED_FREE", "DEFERRED", "HELD"} <= set(states)
    transitions = banner[banner.index(" * Transitions (") : banner.index(" * Locks, ")]
    arrows = re.findall(r"([A-Z_/*]+(?:,\s*\*\s+[A-Z_]+)?) -> \(?([A-Z_/]+|\(free\))", transitions)
    left = {s for a, _ in arrows for s in re.findall(r"[A-Z][A-Z_]+", a)}
    entered = {s for _, b in arrows for s in re.findall(r"[A-Z][A-Z_]+", b)}
    # GRAPH_* stands for both graph states; MEMO is a sub-state of LIVE
    left |= {"GRAPH_LIVE", "GRAPH_FREED"} if "GRAPH_" in left else set()
    for state in set(states) - {"MEMO"}:
        assert state in entered or state == "POOL", f"no transition enters {state}"
        assert state in left, f"no transition leaves {state}"


def test_wait_states_are_named_in_wait_c():
    text = (NATIVE / "wait.c").read_text()
    enum = re.search(r"enum wait_state \{(.*?)\};", text, re.S)
    assert enum, "wait.c names its states in an enum"
    names = re.findall(r"\b(WAIT_[A-Z]+)\b", enum.group(1))
    assert names == ["WAIT_QUEUED", "WAIT_TRY", "WAIT_LAST", "WAIT_SLEEP", "WAIT_LEFT"]
    loop = text[text.index("int wait_for_room(") :]
    assert "switch (state)" in loop
    for name in names:
        assert re.search(rf"\b{name}\b", loop), f"the wait's loop never uses {name}"
