"""The ExecuTorch export skips XNNPACK pattern passes that cannot match (export/executorch.py): exact, and the
skip rule holds for the patterns of the executorch that is installed."""
import pytest

pytest.importorskip("executorch")

from edge.model import mlp  # noqa: E402
from edge.trainers.torch_objectives import build  # noqa: E402
from export import executorch as ex  # noqa: E402


def test_every_pattern_of_a_skipped_pass_holds_its_anchor_ops():
    """The rule "no anchor op in the graph, no match" is only true while every pattern calls every anchor."""
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    patterns = {"ConvertToUpsampleBilinear2d": bilinear_2d.get_graphs(), "ConvertToSDPAPass": sdpa.get_graphs()}
    assert set(patterns) == set(ex.PATTERN_PASS_ANCHORS)
    for name, graphs in patterns.items():
        assert graphs, name
        for g in graphs:
            assert ex.PATTERN_PASS_ANCHORS[name] <= ex.graph_ops(g.graph), (name, sorted(ex.graph_ops(g.graph)))


def test_skip_rule_keeps_every_other_pass_and_a_pass_whose_anchors_are_present():
    class ConvertToSDPAPass: ...
    class ConvertToLinearPass: ...
    class ConvertToUpsampleBilinear2d: ...
    passes = [ConvertToUpsampleBilinear2d, ConvertToLinearPass, ConvertToSDPAPass]
    assert ex.applicable_passes(passes, {"aten.mm.default"}) == [ConvertToLinearPass]
    assert ex.applicable_passes(passes, {"aten._softmax.default"}) == [ConvertToLinearPass]  # bmm missing
    assert ex.applicable_passes(passes, {"aten._softmax.default", "aten.bmm.default"}) == [ConvertToLinearPass,
                                                                                          ConvertToSDPAPass]
    assert ex.applicable_passes(passes, {"aten.upsample_bilinear2d.vec"}) == [ConvertToUpsampleBilinear2d,
                                                                              ConvertToLinearPass]


def test_the_trimmed_export_writes_the_same_program(monkeypatch):
    kept = []
    plain_rule = ex.applicable_passes
    monkeypatch.setattr(ex, "applicable_passes", lambda p, o: kept.append([q.__name__ for q in plain_rule(p, o)])
                        or plain_rule(p, o))
    trimmed = ex.export_executorch(build("fedsparse", mlp([12, 7, 3]), None))
    assert kept and not any("ConvertToSDPAPass" in k or "ConvertToUpsampleBilinear2d" in k for k in kept)
    assert all("ConvertToLinearPass" in k for k in kept)
    from executorch.backends.xnnpack import _passes as xp
    calls = []
    plain = xp.XNNPACKPassManager._fedge_plain_init

    def untrimmed(self, exported_program, passes=None):
        plain(self, exported_program, passes)
        calls.append([p.__name__ for p in self.passes])

    monkeypatch.setattr(xp.XNNPACKPassManager, "__init__", untrimmed)
    full = ex.export_executorch(build("fedsparse", mlp([12, 7, 3]), None))
    assert calls and all("ConvertToSDPAPass" in c for c in calls)  # the untrimmed export ran the full list
    assert trimmed == full
