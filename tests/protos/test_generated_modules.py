"""The generated modules in protos/ are exactly what the .proto sources produce today."""

from pathlib import Path

from protos.generate import ROOT, generate


def test_generated_modules_match_the_sources(tmp_path: Path):
    written = generate(tmp_path)
    assert written, "protoc wrote nothing"
    for path in written:
        committed = ROOT / "protos" / path.name
        assert committed.exists(), f"{path.name} is generated but not committed: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{path.name} is stale: run `make protos`"
    generated_names = {path.name for path in written}
    committed_names = {p.name for p in (ROOT / "protos").glob("*_pb2*.py*")}
    assert committed_names == generated_names, "protos/ holds generated modules without a .proto source"


def test_services_are_the_contract():
    from protos import ar_pb2, dit_pb2

    generator = ar_pb2.DESCRIPTOR.services_by_name["ImageGenerator"]
    assert generator.full_name == "ardit.v1.ImageGenerator"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in generator.methods}
    assert methods["GenerateImage"] == (False, False)
    assert methods["StreamImage"] == (False, True)
    assert methods["GenerateVisualTokens"] == (False, True)
    render = dit_pb2.DESCRIPTOR.services_by_name["Renderer"].methods_by_name["Render"]
    assert (render.client_streaming, render.server_streaming) == (True, True)
