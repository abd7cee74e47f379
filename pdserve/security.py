"""Authentication primitives: client API keys and the cluster secret.

Trust model (docs/deploy.md has the whole of it):

- **Public plane**: the router's ``/v1/*`` routes. With API keys configured, a request carries
  ``Authorization: Bearer KEY``; :class:`APIKeys` checks it. ``/health``, ``/ready`` and
  ``/metrics`` stay open (probes and scrapers carry no key).
- **Internal plane**: the embedded registry (``/registry/*``), the workers' ``/internal/*``
  routes and the KV transceivers. Every process of one deployment shares one cluster secret;
  :class:`ClusterKey` derives from it, by HMAC-SHA256 with a fixed label per use (an HKDF-expand
  step), a bearer token for internal HTTP and a key for challenge-response proofs, so the
  secret itself never crosses the network and a token seen on the wire proves nothing on the
  transfer plane.

Every comparison is constant-time (``hmac.compare_digest``); no key, secret or token is ever
logged, and the classes' ``repr`` shows none.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar

from pdserve.config.settings import SecuritySettings
from pdserve.errors import ConfigError

if TYPE_CHECKING:
    from pdserve.protocol import WorkerRecord

RECORD_LABEL = "record"
"""The :meth:`ClusterKey.proof` label of a worker record's signature."""
KVCACHE_EVENT_LABEL = "kvcache event"
"""The :meth:`ClusterKey.proof` label of a :class:`~pdserve.discovery.kvcache.KVCacheEvent`'s
signature."""
LOAD_EVENT_LABEL = "load event"
"""The :meth:`ClusterKey.proof` label of a :class:`~pdserve.discovery.load_events.LoadEvent`'s
signature."""
KV_BLOCK_EVENT_LABEL = "kv block event"
"""The :meth:`ClusterKey.proof` label of a :class:`~pdserve.discovery.load_events.KVBlockEvent`'s
signature."""

MIN_SECRET_CHARS = 32
"""A cluster secret shorter than this is refused (``pdserve up`` makes 64 hex characters)."""

SECRET_HELP = (
    "the router and every worker need the same cluster secret (it authenticates the registry, "
    "the workers' internal routes and the KV transceivers): create one with `python3 -c "
    "'import secrets; print(secrets.token_hex(32))' > secret && chmod 600 secret` and pass "
    "--cluster-secret-file secret (or set PDSERVE_SECURITY__CLUSTER_SECRET_FILE, or "
    "security.cluster_secret_file in the config file); `pdserve up` makes one for its own "
    "processes"
)


class SignedEvent(Protocol):
    """A control-plane event :meth:`ClusterKey.sign_event` signs: its kind's label (one per
    kind, so that a signature of one kind never verifies as another's), the canonical bytes the
    signature covers (every field but ``signature``) and the hex signature itself."""

    SIGNING_LABEL: ClassVar[str]

    @property
    def signature(self) -> str: ...

    def signing_bytes(self) -> bytes: ...

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Self: ...


_E = TypeVar("_E", bound=SignedEvent)


def generate_secret() -> str:
    """A fresh cluster secret: 64 hex characters (256 bits) from :mod:`secrets`."""
    return secrets.token_hex(32)


def write_secret_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by this user only (mode 0600); returns ``path``."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text + "\n")
    return path


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError.from_problems(
            [f"{what}: cannot read {path}: {exc.strerror or exc}"]
        ) from exc


def load_cluster_secret(sec: SecuritySettings) -> bytes:
    """The cluster secret: ``sec.cluster_secret``, else the contents of
    ``sec.cluster_secret_file`` (surrounding whitespace stripped), as UTF-8 bytes.

    Raises :class:`ConfigError` when neither is set, the file cannot be read, or the secret is
    shorter than :data:`MIN_SECRET_CHARS` characters.
    """
    if sec.cluster_secret is not None:
        text, where = sec.cluster_secret.get_secret_value().strip(), "security.cluster_secret"
    elif sec.cluster_secret_file is not None:
        where = "security.cluster_secret_file"
        text = _read(sec.cluster_secret_file, where).strip()
    else:
        raise ConfigError.from_problems([f"security.cluster_secret_file: not set; {SECRET_HELP}"])
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError.from_problems(
            [
                f"{where}: the cluster secret has {len(text)} characters, at least "
                f"{MIN_SECRET_CHARS} are needed; {SECRET_HELP}"
            ]
        )
    return text.encode()


DEFAULT_TENANT = "default"
"""The tenant of a key that names none (and of every request when no key is configured)."""
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Tenant:
    """Who a client API key belongs to, for the router's fair queue
    (:mod:`pdserve.router.admission`): ``name``, ``weight`` (its share of the workers when they
    are saturated, relative to the other waiting tenants'; > 0) and ``max_queued`` (most of its
    requests waiting at once; None: ``router.tenant_max_queued``)."""

    name: str = DEFAULT_TENANT
    weight: float = 1.0
    max_queued: int | None = None


def parse_key_entry(entry: str, where: str = "API key") -> tuple[str, Tenant]:
    """One API key entry: ``KEY`` alone, or followed by whitespace-separated fields
    ``tenant=NAME`` (letters, digits, ``_.-``; at most 64), ``weight=W`` (a number > 0, at most
    1000) and ``max_queued=N`` (an integer >= 0), e.g. ``sk-team-a tenant=team-a weight=2``.
    Returns (the key, its tenant: :data:`DEFAULT_TENANT` with weight 1 when none is named).
    Raises :class:`ConfigError` naming ``where`` and the field (never the key) for a malformed
    field."""
    key, *fields = entry.split()
    values: dict[str, Any] = {}
    for item in fields:
        name, sep, value = item.partition("=")
        try:
            seen = "name" if name == "tenant" else name
            if not sep or name not in ("tenant", "weight", "max_queued") or seen in values:
                raise ValueError("expected tenant=NAME, weight=W or max_queued=N, once each")
            if name == "tenant":
                if not _TENANT_NAME.match(value):
                    raise ValueError("a tenant name has 1-64 letters, digits, '_', '.' or '-'")
                values["name"] = value
            elif name == "weight":
                weight = float(value)
                if not 0 < weight <= 1000:
                    raise ValueError("a weight is a number above 0 and at most 1000")
                values[name] = weight
            else:
                queued = int(value)
                if queued < 0:
                    raise ValueError("max_queued is an integer >= 0")
                values[name] = queued
        except ValueError as exc:
            raise ConfigError.from_problems(
                [f"{where}: field {name!r} of a key entry: {exc}"]
            ) from None
    return key, Tenant(**values)


def load_api_keys(sec: SecuritySettings) -> tuple[str, ...]:
    """Every client API key entry (:func:`parse_key_entry`): ``sec.api_keys`` plus one per
    non-empty line of ``sec.api_key_file``. Raises :class:`ConfigError` when the file cannot
    be read."""
    keys = [k.get_secret_value() for k in sec.api_keys]
    if sec.api_key_file is not None:
        text = _read(sec.api_key_file, "security.api_key_file")
        keys += [line.strip() for line in text.splitlines() if line.strip()]
    return tuple(k for k in keys if k)


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header value, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class APIKeys:
    """The client API keys of the public ``/v1/*`` routes (OpenAI's ``Authorization: Bearer``)
    and the tenant each names (:func:`parse_key_entry`).

    Empty: every request is allowed. :meth:`check` / :meth:`tenant_of` compare the presented
    token with every key in constant time (no early exit, so timing shows neither which key nor
    how much matched). Raises :class:`ConfigError` when an entry is malformed, or when two keys
    name one tenant with different weights or caps.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        parsed = [parse_key_entry(k) for k in keys if k.strip()]
        self._keys = tuple(key.encode() for key, _ in parsed)
        self._tenants = tuple(tenant for _, tenant in parsed)
        first: dict[str, Tenant] = {}
        for tenant in self._tenants:
            seen = first.setdefault(tenant.name, tenant)
            if seen != tenant:
                raise ConfigError.from_problems(
                    [
                        f"API keys: tenant {tenant.name!r} is named with different weights or "
                        "caps; give every key of one tenant the same fields"
                    ]
                )
        self.tenants: dict[str, Tenant] = first
        """Every tenant the keys name, by name."""
        self.names_tenants = any(t.name != DEFAULT_TENANT for t in self._tenants)
        """Whether some key names a tenant (the router's fair queue is then on by default)."""

    @classmethod
    def from_settings(cls, sec: SecuritySettings) -> APIKeys:
        """See :func:`load_api_keys`; raises :class:`ConfigError`."""
        return cls(load_api_keys(sec))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"APIKeys({len(self._keys)} key(s))"

    def check(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (always True when
        no key is configured)."""
        if not self._keys:
            return True
        return self.tenant_of(authorization) is not None

    def tenant_of(self, authorization: str | None) -> Tenant | None:
        """The tenant of the key an ``Authorization`` header value carries, None when it
        carries none of them; :data:`DEFAULT_TENANT`'s when no key is configured. Every key is
        compared, in constant time."""
        if not self._keys:
            return Tenant()
        token = (bearer(authorization) or "").encode()
        found: Tenant | None = None
        for key, tenant in zip(self._keys, self._tenants, strict=True):
            if hmac.compare_digest(token, key):
                found = tenant
        return found


class ClusterKey:
    """Keys derived from the cluster secret, one per use (HMAC-SHA256 of a fixed label, the
    HKDF-expand construction of RFC 5869 with a single block).

    - :attr:`http_token`: the bearer token of internal HTTP calls (registry, ``/internal/*``);
      check one with :meth:`check_http`.
    - :meth:`proof` / :meth:`verify`: HMAC-SHA256 over a label and length-prefixed parts, for
      challenge-response (the transceiver handshake), signed records (:meth:`sign_record`)
      and signed control-plane events (:meth:`sign_event`: KV cache, load and KV block
      events, one label per kind).

    Holds the secret in memory for the life of the process; ``repr`` never shows it.
    """

    HTTP_LABEL = b"pdserve internal http v1"
    PROOF_LABEL = b"pdserve proof v1"

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError.from_problems(
                [f"cluster secret: at least {MIN_SECRET_CHARS} characters are needed"]
            )
        self._http = hmac.new(secret, self.HTTP_LABEL, hashlib.sha256).hexdigest()
        self._proof_key = hmac.new(secret, self.PROOF_LABEL, hashlib.sha256).digest()

    @classmethod
    def from_settings(cls, sec: SecuritySettings) -> ClusterKey:
        """See :func:`load_cluster_secret`; raises :class:`ConfigError`."""
        return cls(load_cluster_secret(sec))

    def __repr__(self) -> str:
        return "ClusterKey(<hidden>)"

    @property
    def http_token(self) -> str:
        """64 hex characters; send as ``Authorization: Bearer <token>``."""
        return self._http

    def http_headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer <token>"}`` for an internal HTTP client."""
        return {"Authorization": f"Bearer {self._http}"}

    def check_http(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the internal token (constant
        time)."""
        return hmac.compare_digest((bearer(authorization) or "").encode(), self._http.encode())

    def proof(self, label: str, *parts: bytes | str) -> bytes:
        """32-byte HMAC-SHA256 of ``label`` and ``parts``, each length-prefixed so that no two
        different part lists give the same input."""
        mac = hmac.new(self._proof_key, digestmod=hashlib.sha256)
        for part in (label, *parts):
            data = part.encode() if isinstance(part, str) else part
            mac.update(len(data).to_bytes(4, "big"))
            mac.update(data)
        return mac.digest()

    def verify(self, proof: bytes, label: str, *parts: bytes | str) -> bool:
        """Whether ``proof`` is :meth:`proof` of the same label and parts (constant time)."""
        return hmac.compare_digest(proof, self.proof(label, *parts))

    def sign_record(self, record: WorkerRecord) -> WorkerRecord:
        """``record`` with its ``signature`` set: the hex :meth:`proof` (64 characters) of
        its :meth:`~pdserve.protocol.WorkerRecord.signing_bytes` under :data:`RECORD_LABEL`."""
        proof = self.proof(RECORD_LABEL, record.signing_bytes())
        return record.model_copy(update={"signature": proof.hex()})

    def record_signed(self, record: WorkerRecord) -> bool:
        """Whether ``record.signature`` verifies under this key (constant time); False when it
        is missing or not hex."""
        try:
            proof = bytes.fromhex(record.signature)
        except ValueError:
            return False
        return bool(proof) and self.verify(proof, RECORD_LABEL, record.signing_bytes())

    def sign_event(self, event: _E) -> _E:
        """``event`` (a pydantic model: KV cache, load or KV block event) with its
        ``signature`` set: the hex :meth:`proof` of its ``signing_bytes()`` under its kind's
        label (:data:`KVCACHE_EVENT_LABEL`, :data:`LOAD_EVENT_LABEL`,
        :data:`KV_BLOCK_EVENT_LABEL`). One HMAC over the event's canonical JSON."""
        proof = self.proof(event.SIGNING_LABEL, event.signing_bytes())
        return event.model_copy(update={"signature": proof.hex()})

    def event_signed(self, event: SignedEvent) -> bool:
        """Whether ``event.signature`` verifies under this key and the event's kind (constant
        time); False when it is missing or not hex."""
        try:
            proof = bytes.fromhex(event.signature)
        except ValueError:
            return False
        return bool(proof) and self.verify(proof, event.SIGNING_LABEL, event.signing_bytes())


def nonce() -> bytes:
    """16 random bytes for one challenge."""
    return secrets.token_bytes(16)
