"""Control messages between two transceivers and their framing on the wire.

Design origin: the TensorRT-LLM "KV cache transmission" seed (Sender/Receiver exchange control
messages; the Formatter decides the block mapping) and vLLM's NIXL connector (typed handshake
metadata, compatibility check before any byte moves).

Frame = 4-byte big-endian unsigned length + that many bytes of UTF-8 JSON of one message below.
Every message carries a ``type`` tag; the handshake carries ``protocol_version``
(:data:`pdserve.protocol.PROTOCOL_VERSION`), so a peer speaking another version is refused in
:class:`Hello`/:class:`HelloAck` before anything else is exchanged. On the TCP backend the
:class:`BlockData` header is followed, on the same stream, by exactly ``nbytes`` raw KV bytes
(no framing inside). Until the peer is authenticated a frame may hold at most
:data:`PREAUTH_MAX_FRAME_BYTES` (64 KiB), afterwards :data:`MAX_FRAME_BYTES`.

Conversation on one connection (decode D connects to prefill P; :mod:`pdserve.transfer.connection.auth`
has the proofs)::

    D -> P  AuthHello       (D's worker id, nonce n_d)                 | challenge-response
    P -> D  AuthChallenge   (P's worker id, epoch, nonce n_p, proof_p) | on the cluster
            D checks proof_p, else closes (kv_auth_failed)             | secret, both ways;
    D -> P  AuthProof       (proof_d)                                  | frames <= 64 KiB
            P checks proof_d, else answers AuthRefused and closes      |
    D -> P  Hello           (version, worker id, epoch, layout, backend, pool geometry,
                             NIXL agent info / UCX worker address)
    P -> D  HelloAck        (ok, or the refusal's error code + message)
    then per request, any number of times:
    D -> P  SendBlocks      (request id, epoch, lease id, transfer id, src/dst block ids,
                             integrity: whether D wants digests, skip_blocks: leading parked
                             blocks D already holds, not sent)
    P -> D  BlockData + raw bytes   (TCP backend: the byte count is the completion)
      or    TransferDone            (NIXL: after the WRITE completed locally; UCX: after
                                     every tagged send completed)
      or    TransferFailed          (either backend: lookup refused, NIXL error)
    P -> D  BlockDigests    (only if asked: digests of the source bytes, computed as they were
                             sent (TCP: the trailer of the bytes) or right after the WRITE
                             (NIXL, UCX: after TransferDone); D checks them against the
                             landed bytes)
    streamed hand-off (a handle published at admission), per prefill chunk:
    D -> P  SendBlocks      (stream, skip_blocks = blocks D received so far, dst ids for the
                             rest, no src ids)
    P -> D  BlocksReady     (once more blocks are computed: their ids, done + first_token
                             with the last), then the bytes of those blocks as above; D asks
                             again until done, then sends one Release
    D -> P  Abort           (NIXL, only if D gives up before the answer; P stops the WRITE
                             and answers TransferFailed, or TransferDone if it was done)
    D -> P  Release         (after D has the bytes and they passed the digest check; P then
                             releases the parked blocks. A failed check sends no Release.)

D sends Hello right behind AuthProof (it has verified P by then); P reads it only once proof_d
checked out, so nothing of the peer is used before it is proven.

A bandwidth probe (``pdserve doctor``, :mod:`pdserve.transfer.bandwidth_probe`) opens a connection to any
transceiver, authenticates the same way (the doctor needs the cluster secret), then sends Probe
instead of Hello, any number of times; each is answered with ProbeData + ``nbytes`` zero
bytes. No Hello, no KV block is involved.
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pdserve.errors import HandleError, IntegrityError, LayoutMismatchError, TransferError
from pdserve.protocol import PROTOCOL_VERSION, KVLayout

HEADER = struct.Struct(">I")
"""Frame header: payload length in bytes."""

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Upper bound on one control frame (the largest is a Hello with NIXL metadata, a few KiB)."""

PREAUTH_MAX_FRAME_BYTES = 64 * 1024
"""Upper bound on one control frame before the peer is authenticated (the auth frames are
about 200 bytes): what a peer without the cluster secret can make a transceiver allocate."""

MAX_POOL_BLOCKS = 1 << 26
"""Upper bound of a peer's pool size in blocks (its handshake's ``num_blocks``)."""

BACKEND_MISMATCH = "kv_backend_mismatch"
PROTOCOL_MISMATCH = "kv_protocol_mismatch"
AUTH_FAILED = "kv_auth_failed"
"""TransferError code: the peer could not prove it holds the cluster secret (or refused ours)."""
CONNECTION_SHED = "kv_connection_shed"
"""TransferError code: the listener closed a dialled connection before its AuthChallenge
(admission shed it, :mod:`pdserve.transfer.connection.admission`); nothing was exchanged, so the
dialler may dial again."""

_NONCE = r"^[0-9a-f]{32}$"  # 16 bytes (pdserve.security.nonce), hex
_PROOF = r"^[0-9a-f]{64}$"  # 32 bytes (ClusterKey.proof, HMAC-SHA256), hex


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


DigestAlgorithm = Literal["xxh3_64", "mix64"]
"""Block digest algorithms (:data:`pdserve.transfer.integrity.digests.ALGORITHMS`)."""


class NixlPeerInfo(_Wire):
    """What a NIXL WRITE target advertises: its agent and the registered pool region.

    ``metadata_b64`` is ``nixl_agent.get_agent_metadata()`` in base64 (it includes the pool's
    registration). ``pool_addr``/``pool_bytes`` are the pool tensor's base address and size in
    bytes; ``mem_type`` is ``"DRAM"`` or ``"VRAM"``; ``device_id`` is the CUDA index (0 on CPU).
    """

    agent_name: str
    metadata_b64: str
    pool_addr: int = Field(ge=0)
    pool_bytes: int = Field(gt=0)
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: int = Field(default=0, ge=0)


class UcxPeerInfo(_Wire):
    """What a UCX receiver advertises: ``address_b64``, its UCX worker address
    (``UCXWorker.address``, a few hundred bytes) in base64, for the sender's endpoint."""

    address_b64: str = Field(min_length=1)


class AuthHello(_Wire):
    """First frame of every connection, dialer -> listener: who dials (``peer_id``: its worker
    id, or ``pdserve-doctor`` for a probe) and a fresh 16-byte ``nonce`` (hex)."""

    type: Literal["auth_hello"] = "auth_hello"
    protocol_version: int = PROTOCOL_VERSION
    peer_id: str = Field(min_length=1, max_length=256)
    nonce: str = Field(pattern=_NONCE)


class AuthChallenge(_Wire):
    """Listener -> dialer: the listener's incarnation, its own fresh ``nonce`` and ``proof``
    (hex HMAC-SHA256) that it holds the cluster secret, over both nonces and both identities
    (:func:`pdserve.transfer.connection.auth.listener_proof`)."""

    type: Literal["auth_challenge"] = "auth_challenge"
    protocol_version: int = PROTOCOL_VERSION
    worker_id: str = Field(min_length=1, max_length=256)
    epoch: int
    nonce: str = Field(pattern=_NONCE)
    proof: str = Field(pattern=_PROOF)


class AuthProof(_Wire):
    """Dialer -> listener, after it verified the challenge: its own ``proof`` (hex), over the
    nonces in the other order and the other label (:func:`pdserve.transfer.connection.auth.dialer_proof`)."""

    type: Literal["auth_proof"] = "auth_proof"
    proof: str = Field(pattern=_PROOF)


class AuthRefused(_Wire):
    """Listener -> dialer: the dialer's proof did not verify; the connection closes. Carries
    nothing beyond the fact (no identity, no reason)."""

    type: Literal["auth_refused"] = "auth_refused"
    code: Literal["kv_auth_failed"] = "kv_auth_failed"
    message: Literal["authentication failed"] = "authentication failed"


class _PeerIdentity(_Wire):
    """What each side of a handshake says of itself: protocol, incarnation (``worker_id``,
    ``epoch``), KV layout, backend, and ``num_blocks``, its pool size in blocks (the pool
    geometry beyond the layout)."""

    protocol_version: int = PROTOCOL_VERSION
    worker_id: str
    epoch: int
    layout: KVLayout
    backend: str = Field(max_length=64)
    num_blocks: int = Field(gt=0, le=MAX_POOL_BLOCKS)
    pool_device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="where the KV pool lives (chooses the block digest)"
    )


class Hello(_PeerIdentity):
    """First message of a connection, decode -> prefill, with the decode side's identity and
    its backend's peer information."""

    type: Literal["hello"] = "hello"
    nixl: NixlPeerInfo | None = None
    ucx: UcxPeerInfo | None = None


class HelloAck(_PeerIdentity):
    """Prefill -> decode answer to :class:`Hello`, with the prefill side's identity. ``ok=False``
    carries the refusal in ``code``/``message`` (codes of :class:`pdserve.errors.TransferError`
    and subclasses)."""

    type: Literal["hello_ack"] = "hello_ack"
    ok: bool
    code: str | None = None
    message: str | None = None


class SendBlocks(_Wire):
    """Decode -> prefill: move the parked blocks ``src_block_ids`` of ``request_id`` into the
    decode pool's ``dst_block_ids`` (equal layouts: same length, element ``i`` maps to element
    ``i``, every layer). ``transfer_id`` is unique per pull; it tags the NIXL notification.

    Delta transfer: ``skip_blocks`` leading parked blocks are not asked for, because the decode
    worker's prefix cache already holds their K/V; ``src_block_ids`` is then the parked list
    after them (``parked[skip_blocks:]``, never empty). Only between equal layouts."""

    type: Literal["send_blocks"] = "send_blocks"
    request_id: str
    epoch: int
    lease_id: str = Field(min_length=1, description="the handle's lease id (fencing)")
    transfer_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    integrity: bool = Field(default=False, description="answer with BlockDigests")
    digest: DigestAlgorithm = Field(
        default="xxh3_64",
        description="the BlockDigests' algorithm (the pulling side's choice: "
        "pdserve.transfer.integrity.digests.choose_algorithm)",
    )
    skip_blocks: int = Field(default=0, ge=0, description="leading parked blocks not sent")
    stream: bool = Field(
        default=False,
        description="streamed hand-off: src_block_ids is empty; the prefill side answers "
        "BlocksReady with the next computed blocks after skip_blocks, then moves them into "
        "the leading dst_block_ids",
    )


class BlocksReady(_Wire):
    """Prefill -> decode, the answer to a streamed SendBlocks (``stream``): the parked
    blocks after ``skip_blocks`` whose K/V is computed now (``src_block_ids``, in token order,
    maybe empty when ``done``), moved right after this frame exactly as for a plain
    SendBlocks of those ids into the leading ``dst_block_ids`` (BlockData + bytes, or
    TransferDone; BlockDigests when asked). ``done``: the prefill finished and these were the
    last blocks; ``first_token`` is then the token it sampled (the decode side resumes at it).
    """

    type: Literal["blocks_ready"] = "blocks_ready"
    transfer_id: str
    src_block_ids: tuple[int, ...]
    done: bool = False
    first_token: int | None = Field(default=None, ge=0)


class BlockData(_Wire):
    """Prefill -> decode (TCP backend): exactly ``nbytes`` raw KV bytes follow this frame, in
    the order of the transfer plan's segments (layer-major, then block runs). Receiving them
    all completes the transfer; a sender that fails mid-way closes the connection."""

    type: Literal["block_data"] = "block_data"
    transfer_id: str
    nbytes: int = Field(ge=0)


class TransferDone(_Wire):
    """Prefill -> decode (NIXL, UCX backends): the WRITE (NIXL) or every tagged send (UCX) of
    ``transfer_id`` completed locally; the decode side still waits for the NIXL notification,
    which follows the data, or for its own UCX receives to complete."""

    type: Literal["transfer_done"] = "transfer_done"
    transfer_id: str
    nbytes: int = Field(ge=0)


class BlockDigests(_Wire):
    """Prefill -> decode, only when SendBlocks asked: right after the raw bytes on inline
    backends (TCP: the trailer of the BlockData stream), right after TransferDone otherwise;
    the decode side compares them with the landed bytes' digests.

    ``digests`` is base64 of ``len(plan)`` little-endian uint64 ``algorithm`` digests, one per
    transfer-plan segment in plan order, computed over the source bytes the sender moved
    (:mod:`pdserve.transfer.integrity.digests`: as they were sent, or right after the WRITE; the
    parked blocks cannot change meanwhile)."""

    type: Literal["block_digests"] = "block_digests"
    transfer_id: str
    algorithm: DigestAlgorithm = "xxh3_64"
    digests: str


class TransferFailed(_Wire):
    """Prefill -> decode: the transfer did not happen; ``code`` is a TransferError code."""

    type: Literal["transfer_failed"] = "transfer_failed"
    transfer_id: str
    code: str
    message: str


class Abort(_Wire):
    """Decode -> prefill (NIXL backend): the pull of ``transfer_id`` gave up (deadline,
    cancellation); stop writing and answer, so that nothing lands after the answer."""

    type: Literal["abort"] = "abort"
    transfer_id: str


class Release(_Wire):
    """Decode -> prefill: the decode side holds the blocks; the prefill side may free them."""

    type: Literal["release"] = "release"
    request_id: str
    lease_id: str = Field(min_length=1, description="the handle's lease id (required)")


PROBE_MAX_BYTES = 256 * 1024 * 1024
"""Upper bound on one probe's byte count (a larger Probe is refused as malformed)."""


class Probe(_Wire):
    """Doctor -> any transceiver, in place of Hello: answer with :class:`ProbeData` followed
    by ``nbytes`` zero bytes on this connection (they come from a constant buffer, never the KV
    pool)."""

    type: Literal["probe"] = "probe"
    protocol_version: int = PROTOCOL_VERSION
    nbytes: int = Field(ge=0, le=PROBE_MAX_BYTES)


class ProbeData(_Wire):
    """Transceiver -> doctor: who answers (worker id, epoch, backend, KV layout), then exactly
    ``nbytes`` raw bytes follow on the stream."""

    type: Literal["probe_data"] = "probe_data"
    protocol_version: int = PROTOCOL_VERSION
    worker_id: str
    epoch: int
    backend: str
    layout: KVLayout
    nbytes: int = Field(ge=0)


Message = Annotated[
    AuthHello
    | AuthChallenge
    | AuthProof
    | AuthRefused
    | Hello
    | HelloAck
    | SendBlocks
    | BlocksReady
    | BlockData
    | TransferDone
    | BlockDigests
    | TransferFailed
    | Abort
    | Release
    | Probe
    | ProbeData,
    Field(discriminator="type"),
]
_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


def encode(msg: _Wire) -> bytes:
    """One frame: length header + JSON payload."""
    payload = msg.model_dump_json().encode()
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes, limit: int = MAX_FRAME_BYTES) -> int:
    """Payload length from a 4-byte header; raises TransferError past ``limit`` bytes
    (:data:`MAX_FRAME_BYTES`, or :data:`PREAUTH_MAX_FRAME_BYTES` before authentication)."""
    length: int = HEADER.unpack(header)[0]
    if length > limit:
        raise TransferError(f"control frame of {length} bytes exceeds {limit}")
    return length


def decode(payload: bytes | bytearray) -> Message:
    """Parse one frame payload; raises TransferError on anything that is not a known message."""
    try:
        return _MESSAGE.validate_json(payload)
    except ValidationError as exc:
        raise TransferError(f"malformed transfer control message: {exc}") from exc


_ERRORS: dict[str, type[TransferError]] = {
    LayoutMismatchError.code: LayoutMismatchError,
    HandleError.code: HandleError,
    IntegrityError.code: IntegrityError,
}


def error_from_wire(code: str | None, message: str | None) -> TransferError:
    """Rebuild the exception a peer reported: the same class for known codes, else a
    TransferError keeping the peer's code."""
    cls = _ERRORS.get(code or "", TransferError)
    if cls is TransferError:
        return TransferError(message or "peer reported a transfer failure", code=code)
    return cls(message or "peer reported a transfer failure")


def error_code(exc: TransferError) -> str:
    """The wire code of a transfer error (its class default unless overridden)."""
    return exc.code or TransferError.code or "kv_transfer_failed"


def expect_done(msg: Message, transfer_id: str) -> int:
    """Check that ``msg`` completes ``transfer_id``; returns its byte count. Raises the peer's
    error for TransferFailed, TransferError for anything else."""
    if isinstance(msg, TransferFailed) and msg.transfer_id == transfer_id:
        raise error_from_wire(msg.code, msg.message)
    if isinstance(msg, TransferDone) and msg.transfer_id == transfer_id:
        return msg.nbytes
    raise TransferError(f"unexpected {msg.type!r} while waiting for transfer {transfer_id}")
