"""A peer link that resets or stops passing bytes costs a reconnect, not the whole peer time-out.

Real sockets through the chaos driver's TCP proxy (``jaxckpt.tools.chaos.proxy``), plain and CURVE: the request in
flight is lost with its link; the client's socket monitor sees the connection go (a reset at once, a stalled link
once a heartbeat gives up on it) and sends the request again on a fresh socket.
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxckpt import Config
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.backends.transport import ZmqTransport
from jaxckpt.tools.chaos.proxy import PeerProxy
from test_transport import FRAME, TOKEN, _commit

TIMEOUT_S = 20.0  # the client's peer time-out: a stall outlasts it, so only a fresh connection can answer in time


@pytest.fixture(params=["plain", "curve"])
def served(request):
    store = MemoryStore(Config())
    data = np.random.default_rng(1).integers(0, 256, size=3 * FRAME + 17, dtype=np.uint8)
    _commit(store, 3, data, b"manifest-of-step-3")
    t = ZmqTransport(frame_bytes=FRAME, window=3)
    curve = request.param == "curve"
    server = t.serve(store, token=TOKEN, host="127.0.0.1", curve=curve)
    yield t, server, data, server.public_key if curve else ""
    server.close()
    store.close()


@pytest.mark.parametrize("drop", ["reset", "stall"])
def test_a_request_whose_link_drops_is_sent_again_on_a_fresh_connection(served, drop):
    t, server, data, key = served
    proxy = PeerProxy(server.address, seed=0, drop_p=1.0, max_drops=1, stall_max_s=600.0, drops=(drop,),
                      armed=False, io_timeout_s=5.0)
    c = t.connect(proxy.address, token=TOKEN, timeout_s=TIMEOUT_S, server_key=key)
    try:
        assert c.steps() == [3]  # connected (CURVE's handshake done) before the proxy strikes
        proxy.arm()  # the next piece either way is lost: the read's first request, or the server's ping
        got = np.frombuffer(c.read(3, 0, data.size), dtype=np.uint8)
        np.testing.assert_array_equal(got, data)
        st = proxy.stats
        assert (st.resets, st.stalls) == ((1, 0) if drop == "reset" else (0, 1)), st.summary()
        # At least one fresh connection (the old socket may also reconnect on its own before it is closed)
        assert st.connections >= 2 and c.disconnects >= 1, (st.summary(), c.disconnects)
        if drop == "stall":
            # The stall would have held the link far past the time-out: the answer came on the fresh connection
            # the client opened once a heartbeat dropped the silent one.
            assert st.stall_s > TIMEOUT_S and c.resent >= 1, (st.summary(), c.resent)
        assert c.manifest(3) == b"manifest-of-step-3"  # the client goes on over the fresh connection
    finally:
        c.close()
        proxy.close()


def test_the_proxy_names_its_drop_kinds():
    with pytest.raises(ValueError, match="drops must name 'reset' and/or 'stall', got \\('cut',\\)"):
        PeerProxy("tcp://127.0.0.1:1", seed=0, drops=("cut",))
