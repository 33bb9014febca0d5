"""The credentials file and token checks (kvpool/core/auth.py): parsing refuses every
malformed entry with its place named; identify compares against every entry with
hmac.compare_digest (no early exit) and finds the right principal."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpool.core import auth
from kvpool.core.auth import MAX_TOKEN_BYTES, bearer_token, parse_credentials, token_sha256
from kvpool.core.errors import InvalidArgument

NS = "ab" * 16


def creds_bytes(**table: Any) -> bytes:
    return json.dumps(table).encode()


def test_identify_finds_the_principal_and_compares_every_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    tenants = [{"name": f"t{i}", "token_sha256": token_sha256(f"tok{i}"), "namespaces": [NS]} for i in range(5)]
    creds = parse_credentials(
        creds_bytes(
            tenants=tenants,
            admins=[{"name": "ops", "token_sha256": token_sha256("root")}],
            cluster={"token_sha256": token_sha256("nodes")},
        )
    )
    calls: list[int] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for token, name in (("tok0", "t0"), ("tok4", "t4"), ("root", "ops"), ("nodes", "cluster")):
        calls.clear()
        found = creds.identify(token)
        assert found is not None and found.name == name
        assert len(calls) == 7  # 6 principals + the cluster token, whichever matched
    calls.clear()
    assert creds.identify("tok") is None and len(calls) == 7
    assert creds.identify("") is None and creds.identify("x" * (MAX_TOKEN_BYTES + 1)) is None
    t0 = creds.identify("tok0")
    assert t0 is not None and not t0.admin and t0.may_use(bytes.fromhex(NS)) and not t0.may_use(b"\0" * 16)
    ops = creds.identify("root")
    assert ops is not None and ops.admin and ops.may_use(b"\0" * 16)
    assert creds.cluster_token_ok(b"nodes") and not creds.cluster_token_ok(b"tok0")


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"tenants": [{"name": "t", "token_sha256": "plain-token", "namespaces": []}]}, r"tenants\[0\].token_sha256"),
        ({"tenants": [{"name": "t", "token_sha256": "z" * 64}]}, "not hex"),
        ({"tenants": [{"name": "", "token_sha256": "a" * 64}]}, "name"),
        ({"tenants": [{"name": "t", "token_sha256": "a" * 64, "namespaces": ["ab"]}]}, r"namespaces\[0\]"),
        ({"admins": [{"name": "a", "token_sha256": "a" * 64}, {"name": "b", "token_sha256": "a" * 64}]}, "twice"),
        ({"users": []}, "unknown keys"),
        ({}, "no tenant"),
        ({"admins": [{"name": "a", "token_sha256": "a" * 64}], "cluster": {"token_sha256": "a" * 64}}, "cluster"),
    ],
)
def test_malformed_files_are_refused_naming_the_entry(table: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        parse_credentials(creds_bytes(**table))


def test_toml_and_size_limits() -> None:
    text = f'[[admins]]\nname = "ops"\ntoken_sha256 = "{token_sha256("root")}"\n'.encode()
    assert parse_credentials(text, toml=True).identify("root") is not None
    with pytest.raises(InvalidArgument, match="does not parse"):
        parse_credentials(b"[[admins", toml=True)
    with pytest.raises(InvalidArgument, match="limit"):
        parse_credentials(b" " * (auth.MAX_CREDENTIALS_FILE_BYTES + 1))


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") == "" and bearer_token("abc") == ""


def test_the_vllm_connector_takes_a_token_and_keeps_it_out_of_repr() -> None:
    from kvpool.connectors.vllm_spec import ConnectorOptions

    opts = ConnectorOptions.from_extra({"pool_address": "127.0.0.1:7450", "salt": "s", "token": "kvp_secret"})
    assert opts.token == "kvp_secret" and "kvp_secret" not in repr(opts)
    assert ConnectorOptions.from_extra({}).token == ""
    with pytest.raises(InvalidArgument, match="token"):
        ConnectorOptions.from_extra({"token": "x" * (MAX_TOKEN_BYTES + 1)})
    with pytest.raises(InvalidArgument, match="string"):
        ConnectorOptions.from_extra({"token": 5})


def test_the_arena_handoff_request_is_bounded_and_exact() -> None:
    from kvpool.transport.arena_handoff import MAX_REQUEST_BYTES, pack_request, unpack_request

    line = pack_request("w", 42, "kvp_token")
    assert unpack_request(line) == ("w", 42, 0, "kvp_token")
    assert unpack_request(pack_request("r", 0, "")) == ("r", 0, 0, "")
    assert unpack_request(pack_request("r", 7, "t", segment=12)) == ("r", 7, 12, "t")
    assert len(pack_request("r", 2**64 - 1, "t" * MAX_TOKEN_BYTES)) <= MAX_REQUEST_BYTES
    for bad in (b"", b"KVPA1 r 0\n", b"KVPA2 r 0 t\n", b"KVPA1 x 0 t\n", b"KVPA1 r -1 t\n", b"KVPA1 r 0 a b\n",
                b"KVPA1 r " + b"9" * 21 + b" t\n", b"KVPA1 r 0 " + b"t" * (MAX_TOKEN_BYTES + 1) + b"\n"):  # fmt: skip
        with pytest.raises(InvalidArgument):
            unpack_request(bad)
    for mode, put_id, token in (("x", 0, ""), ("r", -1, ""), ("r", 0, "a b"), ("r", 0, "a\n")):
        with pytest.raises(InvalidArgument):
            pack_request(mode, put_id, token)


def test_a_tenant_quota_is_parsed_and_a_namespace_counts_against_one_quota_only() -> None:
    other = "cd" * 16
    creds = parse_credentials(
        creds_bytes(
            tenants=[
                {"name": "a", "token_sha256": token_sha256("ta"), "namespaces": [NS, other], "quota_bytes": 4096},
                {"name": "b", "token_sha256": token_sha256("tb"), "namespaces": [NS]},  # shares NS, no quota
            ]
        )
    )
    ns, ns2 = bytes.fromhex(NS), bytes.fromhex(other)
    assert creds.tenant_quotas() == {ns: ("a", 4096), ns2: ("a", 4096)}
    found = creds.identify("ta")
    assert found is not None and found.quota_bytes == 4096
    for quota in (-1, "1GiB", 1.5, True, 1 << 61):
        with pytest.raises(InvalidArgument, match="quota_bytes"):
            parse_credentials(
                creds_bytes(tenants=[{"name": "a", "token_sha256": token_sha256("x"), "quota_bytes": quota}])
            )
    two = [
        {"name": "a", "token_sha256": token_sha256("ta"), "namespaces": [NS], "quota_bytes": 1},
        {"name": "b", "token_sha256": token_sha256("tb"), "namespaces": [NS], "quota_bytes": 2},
    ]
    with pytest.raises(InvalidArgument, match="one tenant's quota only"):
        parse_credentials(creds_bytes(tenants=two))
