"""The context walkthrough: created contexts on the stack, then the primary context.

Run it: ``python examples/context_walkthrough.py`` (needs a GPU). The test suite runs it too.
"""
from cuproc import Context, PrimaryContext

steps = []

ctx_a = Context.create(0)            # ctxA is made and becomes current
ctx_b = Context.create(0)            # then ctxB: ctxB is current
assert Context.current() == ctx_b
steps.append("B current after create")

ctx_a.push()                         # push ctxA: ctxA is current
assert Context.current() == ctx_a
steps.append("A current after push")

popped = Context.pop()               # pop returns ctxA ...
assert popped == ctx_a
steps.append("pop returned A")
assert Context.current() == ctx_b    # ... and ctxB is current again
steps.append("B current after pop")

assert Context.pop() == ctx_b        # empty this thread's stack (B, then the A that create pushed)
assert Context.pop() == ctx_a
ctx_a.destroy()
ctx_b.destroy()
steps.append("destroyed both")

primary = PrimaryContext(0).retain()   # retain device 0's primary context
flags, active = primary.state
assert active
primary.release()                                 # and release exactly what we retained
steps.append("primary retained and released")

if __name__ == "__main__":
    print("\n".join(steps))
