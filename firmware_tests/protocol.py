"""The wire protocol's conformance vectors (``firmware_tests/protocol/``, docs/protocol.md section 12),
checked against this device's decoder: every valid vector decodes to its JSON, every valid chunk series
reassembles to its whole, every invalid one (message or chunk series) is refused with the reason it names.

``python -m firmware_tests --protocol`` runs it on a device; ``python -m edge.protocol.vectors`` writes them.
"""
from __future__ import annotations

import json
from pathlib import Path

from edge.protocol import wire
from edge.protocol.vectors import decoded_json

VECTORS = Path(__file__).resolve().parent / "protocol"


def reassemble(root: Path, meta: dict) -> tuple[bytes | None, list[str]]:
    """Feed a vector's chunk series, in file order, to one reassembler (section 8): (the payload it yields, or
    None; the reasons of the chunks it refused)."""
    r = wire.Reassembler()
    whole, errors = None, []
    for i in range(meta["chunks"]):
        try:
            c = wire.decode((root / f"{meta['name']}.{i}.msgpack").read_bytes(), expect=("chunk",))
            got = r.feed(meta["kind"], c, 0.0)
        except wire.WireError as e:
            errors.append(str(e))
            continue
        if got is not None:
            whole = got
    return whole, errors


def check(root: Path = VECTORS) -> dict[str, str]:
    """Vector name -> "pass" or why it failed."""
    out: dict[str, str] = {}
    metas = sorted(root.glob("*.json"))
    if not metas:
        return {"(none)": f"no vectors under {root}"}
    for mp in metas:
        meta = json.loads(mp.read_text())
        name = meta["name"]
        try:
            if meta["valid"]:
                payload = (root / f"{name}.msgpack").read_bytes()
                got = json.loads(json.dumps(decoded_json(payload)))
                if got != meta["decoded"]:
                    raise AssertionError("decodes to something else than its JSON")
                if meta.get("chunks"):
                    whole, errors = reassemble(root, meta)
                    if errors or whole != payload:
                        raise AssertionError(f"its chunks do not reassemble to it {errors}")
            elif meta.get("chunks"):  # a refused chunk series: no payload comes out, or it does not decode
                whole, errors = reassemble(root, meta)
                if whole is not None:
                    try:  # the whole must not itself be a chunk (section 8)
                        wire.decode(whole, expect=(meta["kind"],))
                    except wire.WireError as e:
                        errors.append(str(e))
                    else:
                        raise AssertionError("reassembled and decoded; it must be refused")
                if not any(meta["error"] in e for e in errors):
                    raise AssertionError(f"refused, but for another reason: {errors}")
            else:
                try:
                    wire.decode((root / f"{name}.msgpack").read_bytes())
                except wire.WireError as e:
                    if meta["error"] not in str(e):
                        raise AssertionError(f"refused, but for another reason: {e}") from None
                else:
                    raise AssertionError("accepted; it must be refused")
            out[name] = "pass"
        except Exception as e:  # noqa: BLE001 - a verdict per vector
            out[name] = f"{type(e).__name__}: {e}"
    return out
