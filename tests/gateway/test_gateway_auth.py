"""Optional API keys on the gateway: 401 in OpenAI's shape, /health open, keys from env and file."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.auth import key_is_valid, load_api_keys
from gateway.settings import GatewaySettings
from servicekit.settings import load_settings

DEAD = "127.0.0.1:1"  # nothing listens: the routes that pass auth answer 503, which is all we need


def client(**settings) -> TestClient:
    return TestClient(create_app(GatewaySettings(ar_address=DEAD, dit_address=DEAD, **settings)))


def test_no_keys_configured_means_open():
    with client() as c:
        assert c.get("/v1/models").status_code == 503


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic c2stb25l"},
                                     {"Authorization": "sk-one"}, {"Authorization": "Bearer "}])
def test_missing_or_wrong_key_is_401_in_openai_shape(headers):
    with client(api_keys="sk-one,sk-two") as c:
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/v1/images/generations"),
                             ("GET", "/no/such/route")):
            response = c.request(method, path, headers=headers, json={"prompt": "x"})
            assert response.status_code == 401, (path, response.text)
            assert response.json() == {
                "error": {"message": response.json()["error"]["message"], "type": "authentication_error",
                          "param": None, "code": "invalid_api_key"}
            }
            assert response.headers["www-authenticate"] == "Bearer"
            assert "x-request-id" in response.headers


def test_each_configured_key_is_accepted():
    with client(api_keys=" sk-one , sk-two ") as c:
        for key in ("sk-one", "sk-two"):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 503
            assert c.get("/v1/models", headers={"authorization": f"bearer {key}"}).status_code == 503


def test_health_and_docs_stay_open():
    with client(api_keys="sk-one") as c:
        assert c.get("/health").status_code == 503  # open: the probe sees the services' state
        assert c.get("/openapi.json").status_code == 200


def test_keys_from_a_file_and_from_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv("ARDIT_GATEWAY_API_KEYS", "sk-env")
    settings = load_settings(GatewaySettings, ["--api-keys-file", str(keys)])
    assert set(load_api_keys(settings)) == {b"sk-env", b"sk-file-1", b"sk-file-2"}
    assert "sk-env" not in repr(settings) and "sk-env" not in str(settings.model_dump())


def test_a_key_file_without_keys_refuses_to_start(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no keys"):
        create_app(GatewaySettings(api_keys_file=empty))
    with pytest.raises(ValueError, match="cannot read"):
        create_app(GatewaySettings(api_keys_file=tmp_path / "missing"))


def test_key_comparison():
    keys = (b"sk-one", b"sk-two")
    assert key_is_valid(b"sk-two", keys)
    assert not key_is_valid(b"sk-tw", keys)
    assert not key_is_valid(b"", keys)
    assert not key_is_valid(b"sk-one", ())


def test_openapi_documents_real_responses():
    doc = create_app(GatewaySettings()).openapi()
    generations = doc["paths"]["/v1/images/generations"]["post"]["responses"]
    assert generations["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ImagesResponse")
    for status in ("400", "401", "404", "413", "429", "499", "500", "503", "504"):
        assert generations[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ModelList"
    )
    assert set(doc["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
