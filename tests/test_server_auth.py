"""Who may use the server (issue 28): bearer keys on every route but the public ones, admin keys
for admin routes, keys from the config, the environment and files, keys kept out of logs and
answers, TLS (and client certificates) through the official client, the data-parallel front in
front of replicas that take only its token, and no exposed host without a key.

Routes are enumerated from the apps themselves, so a route added later is covered (or this fails).
Servers run on 127.0.0.1 over the tiny engine (tests/helpers.ServerThread); several apps share it.
"""

import asyncio
import contextlib
import logging
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from starlette.routing import Route

from graphexec import ConfigError
from graphexec.parallel.replicas import replica_env, replica_overrides
from graphexec.parallel.router import Router
from graphexec.server.api_keys import (
    ADMIN, ENV_ADMIN_API_KEY, ENV_API_KEY, USER, Keys, exposure_warning, load_keys, replica_key_env, replica_token,
)
from graphexec.server.app import create_app
from graphexec.server.auth import BearerAuth
from graphexec.server.config import ADMIN_ROUTES
from graphexec.server.front import REPLICA_HEADER, create_front_app
from tests.helpers import ServerThread, server_config

REPO = Path(__file__).resolve().parent.parent
TINY = "tiny-llama"
USER_KEY = "user-key-8f3a2c"
OTHER_USER_KEY = "user-key-second-77"
ADMIN_KEY = "admin-key-41d0e9"
WRONG_KEY = "wrong-key-000000"
REPLICA_TOKEN = "replica-token-5b7e"  # the front's per-run token, fixed here to check who sends it
KEYED = {"api_key": [USER_KEY, OTHER_USER_KEY], "admin_api_key": ADMIN_KEY}


@pytest.fixture(autouse=True)
def _no_keys_from_the_environment(monkeypatch):
    # A developer's own GRAPHEXEC_API_KEY must not change what these tests configure.
    monkeypatch.delenv(ENV_API_KEY, raising=False)
    monkeypatch.delenv(ENV_ADMIN_API_KEY, raising=False)


def _http(**options) -> httpx.Client:
    # trust_env=False: never route loopback traffic through a proxy from the environment.
    return httpx.Client(trust_env=False, timeout=60, **options)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD aside (Starlette adds it to GETs)."""

    def walk(routes, prefix: str):
        for route in routes:
            included = getattr(route, "original_router", None)  # FastAPI includes routers lazily
            if included is not None:
                yield from walk(included.routes, prefix + route.include_context.prefix)
            elif getattr(route, "routes", None) is not None:  # a Mount
                yield from walk(route.routes, prefix + route.path)
            else:
                yield from ((m, prefix + route.path) for m in getattr(route, "methods", None) or () if m != "HEAD")

    found = sorted(set(walk(app.routes, "")))
    published = {(m.upper(), path) for path, item in app.openapi()["paths"].items() for m in item}
    assert published <= set(found), f"routes the walk missed: {published - set(found)}"
    return found


def _call(http: httpx.Client, url: str, method: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    # `{}` is no valid body for any route: generation routes answer 400 before any work.
    return http.request(method, url + path, headers=headers, json={} if method == "POST" else None)


def _assert_401(answer: httpx.Response, what: str) -> None:
    assert answer.status_code == 401, (what, answer.status_code, answer.text)
    assert answer.headers["www-authenticate"].startswith("Bearer")
    error = answer.json()["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


def _check_every_route(url: str, routes: list[tuple[str, str]], public: set[str]) -> None:
    """No key and a wrong one: 401 off the public routes; a user key: 403 on admin routes; an
    admin key: everywhere; never a 5xx."""
    with _http() as http:
        for method, path in routes:
            what = f"{method} {path}"
            for headers in (None, _bearer(WRONG_KEY), {"Authorization": f"Basic {USER_KEY}"}):
                answer = _call(http, url, method, path, headers)
                if path in public:
                    assert answer.status_code < 500 and answer.status_code not in (401, 403), (what, answer.text)
                else:
                    _assert_401(answer, what)
            user = _call(http, url, method, path, _bearer(USER_KEY))
            if path in ADMIN_ROUTES:
                assert user.status_code == 403, (what, user.text)
                assert user.json()["error"]["type"] == "permission_error"
            else:
                assert user.status_code < 500 and user.status_code not in (401, 403), (what, user.status_code, user.text)
            admin = _call(http, url, method, path, _bearer(ADMIN_KEY))
            assert admin.status_code < 500 and admin.status_code not in (401, 403), (what, admin.status_code, admin.text)


@contextlib.contextmanager
def _server(engine, **changes):
    app = create_app(engine, server_config(**changes))
    with ServerThread(app) as server:
        yield server, app


@pytest.fixture(scope="module")
def keyed(tiny):
    with _server(tiny, **KEYED) as server_and_app:
        yield server_and_app


# --- keys on every route ------------------------------------------------------------------------


def test_every_route_needs_a_key_but_health(keyed):
    server, app = keyed
    routes = _routes(app)
    paths = {path for _, path in routes}
    assert {"/v1/completions", "/v1/models", "/metrics", "/metrics/json", "/flush_cache", "/openapi.json", "/docs"} <= paths
    _check_every_route(server.url, routes, public={"/health"})


def test_unknown_paths_need_a_key_too(keyed):
    server, _ = keyed
    with _http() as http:
        _assert_401(http.get(server.url + "/no/such/route"), "unknown path")  # routes are not probed without a key
        _assert_401(http.get(server.url + "/health/"), "/health/ is not /health")
        assert http.get(server.url + "/no/such/route", headers=_bearer(USER_KEY)).status_code == 404
        assert http.get(server.url + "/health", headers={"authorization": f"bearer {USER_KEY}"}).status_code == 200


def test_paths_are_checked_as_the_routes_see_them_under_a_root_path():
    """An app mounted under a root_path: its admin route is still one, its public route still public."""
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def call(path: str, key: str | None) -> int:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        scope = {"type": "http", "method": "POST", "path": "/api" + path, "root_path": "/api", "headers": headers}
        await BearerAuth(app, Keys.of([USER_KEY], [ADMIN_KEY]), frozenset({"/health"}))(scope, None, send)
        return sent[0]["status"] if sent else 200

    async def calls() -> list[int]:
        return [await call("/flush_cache", USER_KEY), await call("/health", None), await call("/flush_cache", ADMIN_KEY)]

    assert asyncio.run(calls()) == [403, 200, 200]
    assert reached == ["/api/health", "/api/flush_cache"]


def test_admin_check_covers_the_methods_the_admin_route_serves():
    """A user key gets 403 for what /flush_cache serves; any other method goes on to the router
    (its 405); an admin path no route serves is guarded for every method."""
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["method"])

    async def status(auth: BearerAuth, method: str) -> int:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": "/flush_cache", "headers": [(b"authorization", f"Bearer {USER_KEY}".encode())]}
        await auth(scope, None, send)
        return sent[0]["status"] if sent else 200

    keys = Keys.of([USER_KEY], [ADMIN_KEY])
    routed = BearerAuth(app, keys, frozenset(), routes=[Route("/flush_cache", app, methods=["POST"])])
    unrouted = BearerAuth(app, keys, frozenset())

    async def statuses() -> list[int]:
        return [await status(routed, "POST"), await status(routed, "TRACE"), await status(unrouted, "TRACE")]

    assert asyncio.run(statuses()) == [403, 200, 403]
    assert reached == ["TRACE"]


def test_undeclared_method_is_405_with_allow_for_every_key(keyed):
    """RFC 9110: a 405 says in `Allow` what the route serves; a key holder learns it, even of an
    admin route; without a key nothing is said about routes."""
    server, app = keyed
    served: dict[str, set[str]] = {}
    for method, path in _routes(app):
        served.setdefault(path, set()).add(method)
    with _http() as http:
        for path, methods in served.items():
            for key in (USER_KEY, ADMIN_KEY):
                answer = http.request("TRACE", server.url + path, headers=_bearer(key))
                assert answer.status_code == 405, (path, key, answer.text)
                assert set(answer.headers["allow"].split(", ")) - {"HEAD"} == methods, (path, answer.headers)
                assert answer.json()["error"]["type"] == "invalid_request_error"
            if path != "/health":
                _assert_401(http.request("TRACE", server.url + path), f"TRACE {path} without a key")
        assert http.request("TRACE", server.url + "/health").status_code == 405


def test_admin_route_user_key_403_admin_key_200(keyed):
    server, _ = keyed
    with _http() as http:
        for key in (USER_KEY, OTHER_USER_KEY):
            refused = http.post(server.url + "/flush_cache", headers=_bearer(key))
            assert refused.status_code == 403
            assert refused.json()["error"] == {
                "message": "/flush_cache needs an admin key (server.admin_api_key)",
                "type": "permission_error", "param": None, "code": "admin_key_required",
            }
        flushed = http.post(server.url + "/flush_cache", headers=_bearer(ADMIN_KEY))
    assert flushed.status_code == 200 and "flushed_slots" in flushed.json()


def _published(url: str, key: str | None = USER_KEY) -> dict:
    with _http() as http:
        answer = http.get(url + "/openapi.json", headers=_bearer(key) if key else None)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _assert_documents(schema: dict, public: set[str], keyed: bool = True) -> None:
    """Each operation's `security`, 401 and 403 as BearerAuth treats its path."""
    assert ("bearer" in schema["components"].get("securitySchemes", {})) == keyed
    if keyed:
        assert schema["components"]["securitySchemes"]["bearer"] | {"description": ""} == {
            "type": "http", "scheme": "bearer", "description": "",
        }
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            protected = keyed and path not in public
            what = f"{method} {path}"
            assert (operation.get("security") == [{"bearer": []}]) == protected, what
            responses = operation["responses"]
            assert ("401" in responses) == protected and ("403" in responses) == (protected and path in ADMIN_ROUTES), what
            for status in {"401", "403"} & set(responses):
                assert responses[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
                assert "WWW-Authenticate" in responses[status]["headers"]
    assert not keyed or "ErrorResponse" in schema["components"]["schemas"]


def test_published_schema_documents_the_keys_as_checked(keyed, tiny):
    server, _ = keyed
    schema = _published(server.url)
    _assert_documents(schema, public={"/health"})
    # What it documents is what the server does: every operation without a key is a 401 but /health's.
    operations = [(m.upper(), path) for path, item in schema["paths"].items() for m in item]
    assert ("POST", "/flush_cache") in operations and ("GET", "/health") in operations
    _check_every_route(server.url, operations, public={"/health"})
    with _server(tiny, api_key=USER_KEY, public_metrics=True) as (metrics_public, _):
        _assert_documents(_published(metrics_public.url), public={"/health", "/metrics", "/metrics/json"})


def test_openai_client_with_and_without_the_key(keyed):
    server, _ = keyed
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=USER_KEY, http_client=_http(), max_retries=0)
    answer = client.completions.create(model=TINY, prompt="hello", max_tokens=2)
    assert answer.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model=TINY, prompt="hello", max_tokens=3, stream=True))  # streamed through
    assert chunks and chunks[-1].choices[0].finish_reason is not None
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key=WRONG_KEY, http_client=_http(), max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_public_metrics(tiny):
    with _server(tiny, api_key=USER_KEY, public_metrics=True) as (server, _), _http() as http:
        assert http.get(server.url + "/metrics").status_code == 200
        assert http.get(server.url + "/metrics/json").status_code == 200
        _assert_401(http.get(server.url + "/v1/models"), "only the metrics are public")


def test_no_key_configured_serves_everyone_on_loopback(tiny_server):
    with _http() as http:
        assert http.get(tiny_server.url + "/v1/models").status_code == 200
        assert http.get(tiny_server.url + "/v1/models", headers=_bearer(WRONG_KEY)).status_code == 200


# --- where keys come from -----------------------------------------------------------------------


def test_keys_from_environment_and_file(tiny, tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# one key per line\n\nfile-key-1\n  file-key-2  \n")
    admin_file = tmp_path / "admin_keys"
    admin_file.write_text("admin-file-key\n")
    monkeypatch.setenv(ENV_API_KEY, "env-key-1, env-key-2")
    monkeypatch.setenv(ENV_ADMIN_API_KEY, "admin-env-key")
    config = server_config(api_key="config-key", api_key_file=str(keys_file), admin_api_key_file=str(admin_file))
    keys = load_keys(config)
    for key in ("config-key", "env-key-1", "env-key-2", "file-key-1", "file-key-2"):
        assert keys.role(key.encode()) == USER, key
    for key in ("admin-env-key", "admin-file-key"):
        assert keys.role(key.encode()) == ADMIN, key
    assert keys.role(b"# one key per line") is None and keys.role(b"") is None
    assert keys.role(b"env-key-1, env-key-2") is None
    with _server(tiny, api_key_file=str(keys_file)) as (server, _), _http() as http:
        assert http.get(server.url + "/v1/models", headers=_bearer("env-key-2")).status_code == 200
        assert http.get(server.url + "/v1/models", headers=_bearer("file-key-2")).status_code == 200
        assert http.post(server.url + "/flush_cache", headers=_bearer("admin-env-key")).status_code == 200
        _assert_401(http.get(server.url + "/v1/models"), "keys from env and file")


@pytest.mark.parametrize(
    ("changes", "environ", "message"),
    [
        ({"api_key": ""}, {}, "server.api_key: a key must be a non-empty string"),
        ({"api_key": []}, {}, "server.api_key must be a key, a non-empty list of keys, or null"),
        ({"api_key": ["good-key", "bad key"]}, {}, "server.api_key: a key must be printable ASCII without spaces"),
        ({"admin_api_key": 12345}, {}, "server.admin_api_key must be a key"),
        ({}, {ENV_API_KEY: ""}, "GRAPHEXEC_API_KEY is set but holds an empty key"),
        ({}, {ENV_ADMIN_API_KEY: "a-key,,b-key"}, "GRAPHEXEC_ADMIN_API_KEY is set but holds an empty key"),
        ({"api_key_file": "/no/such/keys"}, {}, "server.api_key_file: cannot read /no/such/keys: No such file"),
        ({"public_routes": ["/health", "/flush_cache"]}, {}, "server.public_routes: /flush_cache is an admin route"),
        ({"public_routes": ["health"]}, {}, "server.public_routes must be a list of paths starting with /"),
        ({"ssl_keyfile": __file__}, {}, "server.ssl_keyfile needs server.ssl_certfile"),
        (
            {"ssl_certfile": __file__, "ssl_cert_reqs": "required"}, {},
            "server.ssl_cert_reqs=required needs server.ssl_ca_certs",
        ),
        ({"ssl_cert_reqs": "sometimes"}, {}, "server.ssl_cert_reqs must be one of ['none', 'optional', 'required']"),
    ],
)
def test_config_errors_name_the_option_and_never_the_key(changes, environ, message, monkeypatch):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as error:
        load_keys(server_config(**changes))
    assert str(error.value).startswith(message), str(error.value)
    assert "good-key" not in str(error.value) and "a-key" not in str(error.value)


def test_key_file_without_keys(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match=rf"server.admin_api_key_file: {empty} holds no key"):
        load_keys(server_config(admin_api_key_file=str(empty)))


# --- keys stay secret ---------------------------------------------------------------------------


@contextlib.contextmanager
def _recorded_logs():
    """Every record of uvicorn's and graphexec's loggers, at every level, as text."""
    names = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "graphexec", "fastapi")
    lines: list[str] = []
    seen: set[int] = set()

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if id(record) not in seen:
                seen.add(id(record))
                lines.append(f"{record.getMessage()} {record.args!r} {self.format(record) if record.exc_info else ''}")

    handler = Recorder(level=1)
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(1)
    try:
        yield lines
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


def test_keys_never_reach_logs_or_answers(tiny, capfd):
    config = server_config(log_level="trace", **KEYED)
    assert USER_KEY not in repr(config) and ADMIN_KEY not in repr(config)
    app = create_app(tiny, config)
    answers = []
    # uvicorn's trace level logs every ASGI message and its access log every request line.
    with _recorded_logs() as lines, ServerThread(app, log_config=None, access_log=True) as server, _http() as http:
        for key in (USER_KEY, WRONG_KEY, ADMIN_KEY):
            answers.append(http.get(server.url + "/v1/models", headers=_bearer(key)))
            answers.append(http.post(server.url + "/flush_cache", headers=_bearer(key)))
            answers.append(http.post(server.url + "/v1/completions", headers=_bearer(key), content=b"{not json"))
    assert [a.status_code for a in answers] == [200, 403, 400, 401, 401, 401, 200, 200, 400]
    assert any("/v1/models" in line for line in lines), "the access log was not recorded"
    logged = "\n".join(lines) + capfd.readouterr().err
    for key in (USER_KEY, WRONG_KEY, ADMIN_KEY):
        assert key not in logged
        assert all(key not in answer.text and key not in str(answer.headers) for answer in answers)


# --- TLS ----------------------------------------------------------------------------------------


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 and its key, made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate (the cryptography package is not installed)")
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def test_tls_round_trip_with_the_openai_client(tiny, tmp_path):
    cert, key = _self_signed(tmp_path, "server")
    with _server(tiny, api_key=USER_KEY, ssl_certfile=str(cert), ssl_keyfile=str(key)) as (server, _):
        url = f"https://127.0.0.1:{server.port}"
        trusted = ssl.create_default_context(cafile=str(cert))
        http_client = _http(verify=trusted)
        with openai.OpenAI(base_url=url + "/v1", api_key=USER_KEY, http_client=http_client, max_retries=0) as client:
            answer = client.completions.create(model=TINY, prompt="hello", max_tokens=2)
        assert answer.usage.completion_tokens >= 1
        with _http(verify=trusted) as http:
            _assert_401(http.get(url + "/v1/models"), "TLS without a key")
        with _http() as http, pytest.raises(httpx.ConnectError):  # an untrusted certificate
            http.get(url + "/health")


def test_required_client_certificate(tiny, tmp_path):
    cert, key = _self_signed(tmp_path, "server")
    client_cert, client_key = _self_signed(tmp_path, "client")
    changes = {
        "ssl_certfile": str(cert), "ssl_keyfile": str(key), "ssl_ca_certs": str(client_cert), "ssl_cert_reqs": "required",
    }
    with _server(tiny, **changes) as (server, _):
        url = f"https://127.0.0.1:{server.port}/health"
        anonymous = ssl.create_default_context(cafile=str(cert))
        refused = (httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError)  # TLS 1.3 fails after the handshake
        with _http(verify=anonymous) as http, pytest.raises(refused):
            http.get(url)
        known = ssl.create_default_context(cafile=str(cert))
        known.load_cert_chain(str(client_cert), str(client_key))
        with _http(verify=known) as http:
            assert http.get(url).status_code == 200


# --- the data-parallel front --------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_front(tiny):
    """A front with user and admin keys before two replica apps (over the one tiny engine) that
    take only the front's token, as graphexec-serve's replicas do."""
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(_server(tiny, admin_api_key=REPLICA_TOKEN))[0] for _ in range(2)]
        app = create_front_app(
            [r.url for r in replicas], Router(2), server_config(**KEYED), replica_token=REPLICA_TOKEN
        )
        front = stack.enter_context(ServerThread(app))
        yield front, app, replicas


def test_front_checks_keys_once_and_replicas_take_only_its_token(keyed_front):
    front, app, replicas = keyed_front
    routes = _routes(app)
    assert ("POST", "/v1/completions") in routes and ("POST", "/flush_cache") in routes
    _check_every_route(front.url, routes, public={"/health"})
    with _http() as http:
        served = http.post(
            front.url + "/v1/completions", headers=_bearer(USER_KEY), json={"model": TINY, "prompt": "hi", "max_tokens": 1}
        )
        assert served.status_code == 200 and served.headers[REPLICA_HEADER] in ("0", "1")
        for replica in replicas:  # a replica's own port is no way around the front's keys
            for key in (USER_KEY, ADMIN_KEY):
                _assert_401(http.get(replica.url + "/v1/models", headers=_bearer(key)), "a client key at a replica")
            assert http.post(replica.url + "/flush_cache", headers=_bearer(REPLICA_TOKEN)).status_code == 200


def test_front_publishes_the_replicas_schema_with_its_own_keys(keyed_front):
    """Replicas take only the front's token; the schema through the front says what the front
    asks of clients, whatever its keys."""
    front, _, replicas = keyed_front
    schema = _published(front.url)
    assert "CompletionRequest" in schema["components"]["schemas"]
    _assert_documents(schema, public={"/health"})
    urls = [r.url for r in replicas]
    open_front = create_front_app(urls, Router(2), server_config(), replica_token=REPLICA_TOKEN)
    metrics_front = create_front_app(urls, Router(2), server_config(api_key=USER_KEY, public_metrics=True), replica_token=REPLICA_TOKEN)
    with ServerThread(open_front) as unkeyed, ServerThread(metrics_front) as public_metrics:
        _assert_documents(_published(unkeyed.url, key=None), public=set(), keyed=False)
        _assert_documents(_published(public_metrics.url), public={"/health", "/metrics", "/metrics/json"})


def test_replica_token_travels_in_the_environment_not_the_command_line():
    assert replica_token() != replica_token() and len(replica_token()) >= 32  # per run, unguessable
    front_overrides = ["model=tiny-llama", f"server.api_key={USER_KEY}", "server.host=0.0.0.0", "server.ssl_certfile=/c"]
    command = replica_overrides(front_overrides, 4321, 1)
    assert USER_KEY not in " ".join(command) and REPLICA_TOKEN not in " ".join(command)
    replica_server = {"server.host=127.0.0.1", "server.api_key=null", "server.ssl_certfile=null", "server.public_routes=[/health]"}
    assert replica_server <= set(command)
    front_env = {ENV_API_KEY: USER_KEY, ENV_ADMIN_API_KEY: ADMIN_KEY, "PATH": "/bin"}
    env = replica_env(front_env, 1, replica_key_env(REPLICA_TOKEN))
    assert env[ENV_ADMIN_API_KEY] == REPLICA_TOKEN and ENV_API_KEY not in env and env["PATH"] == "/bin"


# --- no exposed host without a key --------------------------------------------------------------


def test_non_loopback_host_without_a_key_is_refused(tiny):
    with pytest.raises(ConfigError) as refused:
        create_app(tiny, server_config(host="0.0.0.0"))
    message = str(refused.value)
    assert "server.host=0.0.0.0" in message
    assert "server.api_key" in message and ENV_API_KEY in message and "server.allow_unauthenticated=true" in message
    with pytest.raises(ConfigError, match="server.host=10.1.2.3"):
        create_front_app(["http://127.0.0.1:9"], Router(1), server_config(host="10.1.2.3"))


@pytest.mark.parametrize(
    ("changes", "warning"),
    [
        ({"host": "127.0.0.1"}, None),
        ({"host": "::1"}, None),
        ({"host": "localhost"}, None),
        ({"host": "0.0.0.0", "api_key": USER_KEY}, "without TLS"),
        ({"host": "0.0.0.0", "allow_unauthenticated": True}, "anyone who can reach this port"),
        ({"host": "0.0.0.0", "ssl_certfile": __file__, "ssl_ca_certs": __file__, "ssl_cert_reqs": "required"}, None),
    ],
)
def test_hosts_that_are_served(changes, warning):
    config = server_config(**changes)
    found = exposure_warning(config, load_keys(config))
    assert (found is None) if warning is None else (warning in found), found


def test_graphexec_serve_refuses_before_loading_the_model():
    env = {k: v for k, v in os.environ.items() if k not in (ENV_API_KEY, ENV_ADMIN_API_KEY)}
    command = [sys.executable, "-m", "graphexec.entrypoints.serve", "model=tiny-llama", "capture=eager",
               "server.host=0.0.0.0", "server.port=0"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "server.allow_unauthenticated=true" in result.stderr and ENV_API_KEY in result.stderr
    assert "graphexec-serve: model=" not in result.stderr  # refused before the model loaded
