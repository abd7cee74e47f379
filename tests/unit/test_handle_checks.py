"""The decode worker refuses a transfer handle that cannot fill the request's blocks, and KV
blocks that arrived corrupted."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from pdserve.config.settings import TransferSettings
from pdserve.errors import HandleError, IntegrityError, LayoutMismatchError, TransferError
from pdserve.protocol import GenerationRequest, KVLayout, SamplingParams, TransferHandle
from pdserve.workers.engine.requests import Reservation
from pdserve.workers.roles.decode import DecodeHandler, check_handle
from tests.support.transfer import handed_generation

LAYOUT = KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4,
                  dtype="float32")  # fmt: skip
ENGINE = SimpleNamespace(layout=LAYOUT)


def _req(n_tokens: int = 10, **handle_fields: object) -> GenerationRequest:
    """A request of 10 prompt tokens whose handle claims ``n_tokens`` tokens."""
    return handed_generation(10, LAYOUT, num_tokens=n_tokens, **handle_fields)


def test_matching_handle_is_accepted() -> None:
    req = _req()
    check_handle(req, req.handle, ENGINE)


def test_token_count_mismatch_is_refused() -> None:
    req = _req(n_tokens=9)
    with pytest.raises(HandleError, match="9 tokens"):
        check_handle(req, req.handle, ENGINE)


def test_wrong_number_of_blocks_is_refused() -> None:
    req = _req(block_ids=(0, 1))
    with pytest.raises(HandleError, match="need 3"):
        check_handle(req, req.handle, ENGINE)


def test_layout_mismatch_names_the_field() -> None:
    other = LAYOUT.model_copy(update={"num_kv_heads": 4})  # no formatter maps KV heads
    req = _req(layout=other)
    with pytest.raises(LayoutMismatchError, match="num_kv_heads: 4 != 2"):
        check_handle(req, req.handle, ENGINE)


def test_expired_lease_is_refused() -> None:
    req = _req(lease_deadline=time.time() - 1)
    with pytest.raises(HandleError, match="expired"):
        check_handle(req, req.handle, ENGINE)


def test_handle_for_another_request_is_refused() -> None:
    req = _req(request_id="other")
    with pytest.raises(HandleError, match="other"):
        check_handle(req, req.handle, ENGINE)


def test_repeated_block_ids_are_refused() -> None:
    req = _req(block_ids=(0, 1, 1))
    with pytest.raises(HandleError, match="repeated"):
        check_handle(req, req.handle, ENGINE)


def test_negative_block_ids_are_refused() -> None:
    req = _req(block_ids=(0, -1, 2))
    with pytest.raises(HandleError, match="negative"):
        check_handle(req, req.handle, ENGINE)


def test_handle_without_a_lease_id_does_not_parse() -> None:
    with pytest.raises(ValidationError, match="lease_id"):
        _req(lease_id="")


class _Engine:
    """The engine calls DecodeHandler makes around a transfer (logic around the real path)."""

    layout = LAYOUT

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reserve(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, **_: object
    ) -> Reservation:
        self.calls.append("reserve")
        return Reservation([7, 8, 9])

    def unreserve(self, request_id: str) -> None:
        self.calls.append("unreserve")

    def add_request(self, *args: object) -> None:
        self.calls.append("add_request")


class _CorruptingTransceiver:
    async def pull(
        self, handle: TransferHandle, dst_block_ids: list[int], *, skip_blocks: int = 0
    ) -> None:
        raise IntegrityError("layer 0, decode block 7 (prefill block 0) arrived corrupted")


async def test_blocks_that_fail_the_digest_check_are_unreserved_at_once_and_never_resumed() -> None:
    engine = _Engine()
    role = DecodeHandler(engine=engine, transceiver=_CorruptingTransceiver())  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match="decode block 7"):
        await role.admit(_req())
    assert engine.calls == ["reserve", "unreserve"], "freed now, not quarantined, not resumed"
    assert role.quarantined == 0


class _FailingTransceiver:
    def __init__(self, late_writes: bool) -> None:
        self.late_writes = late_writes

    async def pull(
        self, handle: TransferHandle, dst_block_ids: list[int], *, skip_blocks: int = 0
    ) -> None:
        raise TransferError("transfer peer p:1 lost while receiving: Connection reset by peer")


@pytest.mark.parametrize("late_writes", [False, True])
async def test_a_failed_pull_frees_its_blocks_at_once_unless_a_write_may_still_land(
    late_writes: bool,
) -> None:
    engine = _Engine()
    role = DecodeHandler(
        engine=engine,  # type: ignore[arg-type]
        transceiver=_FailingTransceiver(late_writes),  # type: ignore[arg-type]
        transfer=TransferSettings(timeout_s=30.0),  # the quarantine
    )
    with pytest.raises(TransferError, match="lost while receiving"):
        await role.admit(_req())
    if late_writes:  # NIXL, UCX, CUDA staging: held until no write can land
        assert engine.calls == ["reserve"] and role.quarantined == 1
    else:  # TCP into a CPU pool: nothing writes once the pull ended
        assert engine.calls == ["reserve", "unreserve"] and role.quarantined == 0
