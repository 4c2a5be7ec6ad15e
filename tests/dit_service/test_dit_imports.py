"""dit_service's and the gateway's modules import each other without a circle (the check of
tests/ar_service/test_ar_imports.py): every import counts, a function's own too."""

from __future__ import annotations

import pytest

from tests.ar_service.test_ar_imports import ROOT, cycles, module_graph


@pytest.mark.parametrize("package", ["dit_service", "gateway", "servicekit"])
def test_the_package_imports_without_a_circle(package):
    graph = module_graph(ROOT, package)
    assert len(graph) > 3
    assert cycles(graph) == []


def test_the_q_former_and_the_transformer_share_their_blocks_without_importing_each_other():
    graph = module_graph(ROOT, "dit_service")
    assert "dit_service.model.refiner" in graph["dit_service.model.transformer"]
    assert "dit_service.model.transformer" not in graph["dit_service.model.refiner"]
    assert "dit_service.model.layers" in graph["dit_service.model.refiner"]
