# ruff: noqa
import threading, time, torch.distributed as dist
from accel_mixin.distributed.control import Control


def ranks(*bodies, timeout=5):
    store = dist.HashStore()
    cs = [Control(len(bodies), r, timeout=timeout, store=store) for r in range(len(bodies))]
    res = [None] * len(bodies)

    def go(i):
        t0 = time.monotonic()
        try:
            res[i] = ("ok", bodies[i](cs[i]))
        except BaseException as e:
            res[i] = (type(e).__name__, str(e)[:160])
        res[i] += (round(time.monotonic() - t0, 2),)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    return res


def ok(c):
    with c.session("fit"):
        c.barrier("b")
        c.barrier("b2")


print("plain", ranks(ok, ok))


def bad(c):
    with c.session("fit"):
        c.barrier("b")
        with c.section("on_epoch_end"):
            raise ValueError("boom")


def good(c):
    with c.session("fit"):
        c.barrier("b")
        with c.section("on_epoch_end"):
            time.sleep(0.5)
            c.barrier("on_epoch_end")


print("error", ranks(good, bad, good))


def a(c):
    with c.session("fit"):
        c.barrier("x")


def b(c):
    with c.session("save_params"):
        c.barrier("x")


print("mismatch", ranks(a, b))


def late(c):
    c.group()
    time.sleep(8)
    return "late"


def okw(c):
    c.group()
    ok(c)


print("missing", ranks(okw, late, okw, timeout=2))
print(
    "run",
    ranks(
        *[lambda c: c.run(lambda: c.process_index, what="save_params", here=c.process_index == 0)]
        * 2
    ),
)
