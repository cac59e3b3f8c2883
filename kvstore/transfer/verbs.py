"""Thin wrappers over pyverbs for the RDMA transport: device, registration, RC queue pairs.

pyverbs is imported on first use (:func:`load_verbs`), so importing this
module never needs it. Every failure of the verbs layer becomes
:class:`~kvstore.errors.Unavailable` with what went wrong.

Thread safety: an :class:`RdmaDevice` (context, PD) may be shared by
threads; an :class:`RcQueuePair` is driven by one thread at a time.
:meth:`RcQueuePair.run` busy-polls its CQ: call it from a worker thread,
never an event loop.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from kvstore.errors import Unavailable
from kvstore.transfer.rdma_wire import QpDescriptor, address_of, gid_to_bytes, gid_to_text

log = logging.getLogger(__name__)


class _Verbs:
    """The pyverbs modules and the constants we use, resolved once."""

    _NAMES = ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ",
              "IBV_QPT_RC", "IBV_WR_RDMA_WRITE", "IBV_WR_RDMA_READ", "IBV_SEND_SIGNALED",
              "IBV_WC_SUCCESS", "IBV_LINK_LAYER_ETHERNET")

    def __init__(self) -> None:
        try:
            import pyverbs.addr as addr
            import pyverbs.cq as cq
            import pyverbs.device as device
            import pyverbs.mr as mr
            import pyverbs.pd as pd
            import pyverbs.qp as qp
            import pyverbs.wr as wr
        except ImportError as exc:
            raise Unavailable(
                f"RDMA needs pyverbs, which cannot be imported ({exc}); install the 'rdma' "
                "extra (pip install 'kvstore[rdma]', builds rdma-core's bindings) or Debian's "
                "python3-pyverbs") from exc
        try:   # rdma-core >= 50 names the module libibverbs_enums; older ones, enums
            import pyverbs.libibverbs_enums as enums
        except ImportError:
            import pyverbs.enums as enums
        self.addr, self.cq, self.device, self.mr, self.pd, self.qp, self.wr = (
            addr, cq, device, mr, pd, qp, wr)
        for name in self._NAMES:
            setattr(self, name, self._constant(enums, name))

    @staticmethod
    def _constant(enums: Any, name: str) -> int:
        v = getattr(enums, name, None)
        if v is None:   # only inside its enum class (cpdef enum of newer Cython)
            for obj in vars(enums).values():
                if isinstance(obj, type) and hasattr(obj, name):
                    v = getattr(obj, name)
                    break
        if v is None:
            raise Unavailable(f"this pyverbs has no {name}")
        return int(v)


_verbs_lock = threading.Lock()
_verbs: _Verbs | None = None


def load_verbs() -> _Verbs:
    """pyverbs, imported on first use.

    Raises:
        Unavailable: pyverbs is not installed (the message says how to get it).
    """
    global _verbs
    with _verbs_lock:
        if _verbs is None:
            _verbs = _Verbs()
        return _verbs


class RdmaDevice:
    """An opened RDMA device port: context, protection domain, addressing.

    Args:
        name: device name (``ibv_devices``; e.g. ``mlx5_0``, ``rxe0``).
        port: physical port number.
        gid_index: GID table index; None = the first non-zero GID (RoCE needs
            one; between hosts pick the RoCEv2 GID of the routable address,
            ``show_gids``).

    Raises:
        Unavailable: no pyverbs, no such device, or the port has no usable address.
    """

    def __init__(self, name: str, port: int = 1, gid_index: int | None = None):
        v = self.v = load_verbs()
        self.name, self.port = name, port
        try:
            self.ctx = v.device.Context(name=name)
        except Exception as exc:   # pyverbs raises PyverbsError / PyverbsRDMAError
            raise Unavailable(f"cannot open RDMA device {name!r}: {exc} (see ibv_devices; "
                              "soft-RoCE: rdma link add rxe0 type rxe netdev <if>)") from exc
        try:
            self.pd = v.pd.PD(self.ctx)
            attr = self.ctx.query_port(port)
            dev = self.ctx.query_device()
            self.lid = int(attr.lid)
            self.mtu = int(attr.active_mtu)
            self.ethernet = int(attr.link_layer) == v.IBV_LINK_LAYER_ETHERNET
            self.max_rd_atomic = max(1, min(16, int(dev.max_qp_rd_atom),
                                            int(dev.max_qp_init_rd_atom)))
            self.gid_index, self.gid = self._pick_gid(int(attr.gid_tbl_len), gid_index)
        except Unavailable:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise Unavailable(f"RDMA device {name!r} port {port}: {exc}") from exc

    def _pick_gid(self, table_len: int, wanted: int | None) -> tuple[int, bytes]:
        indices = [wanted] if wanted is not None else range(max(table_len, 1))
        for i in indices:
            try:
                gid = gid_to_bytes(str(self.ctx.query_gid(self.port, i)))
            except Exception:
                continue
            if any(gid):
                return i, gid
        if self.ethernet:
            raise Unavailable(f"RDMA device {self.name!r} port {self.port} has no usable GID "
                              f"(index {wanted}); RoCE needs one")
        return 0, bytes(16)   # InfiniBand: LID routing

    def register(self, view: memoryview, remote: bool) -> Any:
        """Register ``view``'s memory (it must outlive the returned MR).

        Args:
            remote: allow remote read and write (the node's segment).

        Raises:
            Unavailable: registration failed (e.g. locked-memory limit: ulimit -l).
        """
        v = self.v
        access = v.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= v.IBV_ACCESS_REMOTE_READ | v.IBV_ACCESS_REMOTE_WRITE
        try:
            return v.mr.MR(self.pd, len(view), access, address=address_of(view))
        except Exception as exc:
            raise Unavailable(f"registering {len(view)} B with {self.name!r} failed: {exc} "
                              "(check ulimit -l)") from exc

    def queue_pair(self, depth: int) -> "RcQueuePair":
        return RcQueuePair(self, depth)

    def close(self) -> None:
        for obj in (getattr(self, "pd", None), getattr(self, "ctx", None)):
            if obj is not None:
                close_quietly(obj)


class RcQueuePair:
    """One reliable-connected QP and its completion queue.

    Args:
        device: the opened device.
        depth: send queue depth (work requests in flight).
    """

    def __init__(self, device: RdmaDevice, depth: int):
        v = self.v = device.v
        self.device = device
        self.depth = depth
        try:
            self.cq = v.cq.CQ(device.ctx, depth)
            cap = v.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = v.qp.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                                   sq_sig_all=0)
            self.qp = v.qp.QP(device.pd, init)
        except Exception as exc:
            self.close()
            raise Unavailable(f"creating a queue pair on {device.name!r} failed: {exc}") from exc
        self.psn = secrets.randbits(24)

    def descriptor(self) -> QpDescriptor:
        d = self.device
        return QpDescriptor(qpn=int(self.qp.qp_num), psn=self.psn, lid=d.lid, gid=d.gid,
                            port=d.port, mtu=d.mtu, gid_index=d.gid_index,
                            rd_atomic=d.max_rd_atomic)

    def connect(self, remote: QpDescriptor) -> None:
        """Move the QP through INIT, RTR and RTS towards ``remote``.

        Raises:
            Unavailable: a transition failed (unreachable peer, bad attributes).
        """
        v, d = self.v, self.device
        try:
            attr = v.qp.QPAttr(port_num=d.port)
            attr.pkey_index = 0
            attr.qp_access_flags = (v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_READ
                                    | v.IBV_ACCESS_REMOTE_WRITE)
            attr.path_mtu = min(d.mtu, remote.mtu)
            attr.dest_qp_num = remote.qpn
            attr.rq_psn = remote.psn
            attr.max_dest_rd_atomic = d.max_rd_atomic
            attr.min_rnr_timer = 12
            if any(remote.gid):
                route = v.addr.GlobalRoute(dgid=v.addr.GID(gid_to_text(remote.gid)),
                                           sgid_index=d.gid_index, hop_limit=1)
                attr.ah_attr = v.addr.AHAttr(port_num=d.port, is_global=1, gr=route,
                                             dlid=remote.lid)
            else:
                attr.ah_attr = v.addr.AHAttr(port_num=d.port, is_global=0, dlid=remote.lid)
            attr.timeout = 14        # 4.096 us * 2**14 = 67 ms per retry
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.sq_psn = self.psn
            attr.max_rd_atomic = max(1, min(d.max_rd_atomic, remote.rd_atomic))
            self.qp.to_rts(attr)     # goes through INIT and RTR
        except Exception as exc:
            raise Unavailable(f"connecting queue pair {self.qp.qp_num} to {remote.qpn} "
                              f"failed: {exc}") from exc

    def run(self, ops: list[tuple[bool, int, int, int, int, int]], timeout_s: float
            ) -> list[bool]:
        """Post one-sided ops and wait for all of them.

        Args:
            ops: ``(is_write, local_addr, lkey, length, remote_addr, rkey)``.
            timeout_s: for the whole list.

        Returns:
            Per op, True when it completed successfully. After a failure the
            QP is in the error state: the caller must drop it.
        """
        v = self.v
        ok = [False] * len(ops)
        deadline = time.monotonic() + timeout_s
        posted = done = 0
        failed = False
        while done < len(ops):
            while not failed and posted < len(ops) and posted - done < self.depth:
                is_write, laddr, lkey, n, raddr, rkey = ops[posted]
                wr = v.wr.SendWR(wr_id=posted,
                                 opcode=v.IBV_WR_RDMA_WRITE if is_write else v.IBV_WR_RDMA_READ,
                                 num_sge=1, sg=[v.wr.SGE(laddr, n, lkey)],
                                 send_flags=v.IBV_SEND_SIGNALED)
                wr.set_wr_rdma(rkey, raddr)
                try:
                    self.qp.post_send(wr)
                except Exception as exc:
                    log.warning("RDMA post failed: %s", exc)
                    failed = True
                    break
                posted += 1
            if failed and done == posted:
                break
            n, wcs = self.cq.poll(self.depth)
            for wc in wcs:
                done += 1
                if wc.status == v.IBV_WC_SUCCESS:
                    ok[wc.wr_id] = True
                else:
                    failed = True
                    log.warning("RDMA op %d failed: status %s (vendor %s)", wc.wr_id,
                                wc.status, wc.vendor_err)
            if not n:
                if time.monotonic() > deadline:
                    log.warning("RDMA ops timed out after %.1f s (%d of %d done)", timeout_s,
                                done, len(ops))
                    break
                time.sleep(0)   # let other threads run between polls
        return ok

    def close(self) -> None:
        for obj in (getattr(self, "qp", None), getattr(self, "cq", None)):
            if obj is not None:
                close_quietly(obj)


def close_quietly(obj: Any) -> None:
    try:
        obj.close()
    except Exception:   # pyverbs errors on double close or a dead device
        pass
