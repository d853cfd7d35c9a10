"""NATS credentials for a deployment: one nkey per service, and the nats-server authorization that
lets each publish and subscribe only where its role needs to.

    radixflow creds DIR        -> DIR/<service>.nk (a seed, 0600) for each service and for `client`
                                  (a NATS API client), DIR/auth.conf (include it in nats-server's config)
    RADIXFLOW_BUS_NKEY_DIR=DIR -> each service connects with DIR/<its service>.nk

Without a valid key a client is refused at connect ("Authorization Violation": every user has an
nkey, and there is no anonymous user). Each service's inbox is `_INBOX.<service>` (its request
replies and its streams arrive there, and only it may subscribe to it); services answer requests
through NATS's allow_responses, which lets a responder publish to the reply subject of a request it
received and nowhere else. `radixflow up` (embedded) and `up --processes` make an ephemeral set per
run when none is given. TLS (for clients, and between the nodes of a NATS cluster, whose routes
nkeys do not guard) is shared/certs.py: `radixflow creds DIR --tls`.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import subjects

_ALL = ("rf.heartbeat.>",)      # every service watches the others' beats


def inbox_prefix(role: str) -> str:
    return f"_INBOX.{role}"


# what each role may publish (beyond the replies to requests it received) and subscribe to
PERMISSIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gateway": (
        (subjects.SCHEDULER_SUBMIT, subjects.SCHEDULER_ABORT, subjects.SCHEDULER_PROGRAM, subjects.PROGRAM_GET,
         subjects.PROGRAM_CANCEL, "rf.scheduler.*.program.*", "rf.scheduler.*.live", "rf.scheduler.*.resend",
         subjects.TOKENIZER_ENCODE, subjects.TOKENIZER_DETOKENIZE, subjects.TOKENIZER_INFO, subjects.RADIX_FLUSH,
         "rf.*.status", subjects.METRICS, subjects.MEMORY, "rf.heartbeat.gateway"),
        ("rf.gateway.>", subjects.METRICS) + _ALL),
    "scheduler": (
        (subjects.TOKENIZER_ENCODE, subjects.TOKENIZER_DETOKENIZE, subjects.TOKENIZER_INFO, subjects.GRAMMAR_COMPILE,
         subjects.RADIX_PLACE, "rf.executor.*.submit", "rf.executor.*.abort", "rf.executor.*.hints",
         "rf.executor.*.live", "rf.executor.*.replay", "rf.executor.*.ping", "rf.heartbeat.scheduler",
         # the streams it answers into: a gateway's or a NATS client's (never another service's inbox)
         inbox_prefix("gateway") + ".rf.*", inbox_prefix("client") + ".rf.*"),
        ("rf.scheduler.>", subjects.METRICS) + _ALL),
    "executor": (
        (subjects.RADIX_REGISTER, subjects.RADIX_ADOPT, "rf.radix.pool.*.step", subjects.GRAMMAR_FETCH,
         "rf.scheduler.*.output", "rf.scheduler.*.ping", "rf.heartbeat.executor",
         "rf.executor.*.kv"),       # a prefill executor's pages into a decode executor's host tier
        ("rf.executor.>", subjects.METRICS, subjects.MEMORY) + _ALL),
    "tokenizer": (("rf.heartbeat.tokenizer",), ("rf.tokenizer.>", subjects.METRICS) + _ALL),
    "grammar": (("rf.heartbeat.grammar",), ("rf.grammar.>", subjects.METRICS) + _ALL),
    "radix": (("rf.heartbeat.radix",), ("rf.radix.>", subjects.METRICS) + _ALL),
    # a program using the public NATS API: submit, abort, programs, and its own streams
    "client": ((subjects.SCHEDULER_SUBMIT, subjects.SCHEDULER_ABORT, subjects.SCHEDULER_PROGRAM, subjects.PROGRAM_GET,
                subjects.PROGRAM_CANCEL, "rf.scheduler.*.program.*", subjects.TOKENIZER_ENCODE,
                subjects.TOKENIZER_DETOKENIZE), ()),
}
ROLES = tuple(PERMISSIONS)


def _quoted(xs) -> str:
    return "[" + ", ".join(f'"{x}"' for x in xs) + "]"


def server_conf(public_keys: dict[str, str]) -> str:
    """The `authorization` block for nats-server: one nkey user per role."""
    users = []
    for role, key in public_keys.items():
        pub, sub = PERMISSIONS[role]
        sub = tuple(sub) + (inbox_prefix(role) + ".>",)
        users.append(f'    {{nkey: "{key}", permissions: {{publish: {{allow: {_quoted(pub or ("_none_",))}}}, '
                     f'subscribe: {{allow: {_quoted(sub)}}}, allow_responses: true}}}}  # {role}')
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def generate(directory: str | os.PathLike) -> dict[str, str]:
    """A seed per role in `directory` (0600; the directory 0700) and auth.conf; returns role ->
    public key. An existing seed is kept (re-running adds what is missing, rotates nothing)."""
    import nkeys
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    public = {}
    for role in ROLES:
        path = d / f"{role}.nk"
        if not path.exists():
            seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(seed + b"\n")
        public[role] = nkeys.from_seed(path.read_bytes().strip()).public_key.decode()
    conf = d / "auth.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(server_conf(public))
    return public


class Ephemeral:
    """Credentials for one run of an embedded nats-server: RADIXFLOW_BUS_NKEY_DIR's if it is set
    (completed where roles are missing), else a fresh 0700 temporary directory, removed at close."""

    def __init__(self) -> None:
        import tempfile
        given = os.environ.get("RADIXFLOW_BUS_NKEY_DIR", "")
        self.dir = given or tempfile.mkdtemp(prefix="radixflow-nats-")
        self._own = not given
        self.public = generate(self.dir)
        self.server_conf = server_conf(self.public)
        self.env = {"RADIXFLOW_BUS_NKEY_DIR": self.dir}

    def close(self) -> None:
        if self._own:
            import shutil
            shutil.rmtree(self.dir, ignore_errors=True)


def seed_file(directory: str, role: str) -> str:
    path = os.path.join(directory, f"{role}.nk")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no NATS key for {role!r} in {directory} (make them with `radixflow creds {directory}`)")
    return path
