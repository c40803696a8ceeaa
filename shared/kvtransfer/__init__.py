"""KV transfers: how a prompt's KV leaves a prefill worker's pool and lands in a decode worker's.

One home for the whole protocol: the two state machines on one base (machine.py; inbound.py for
the decode side, outbound.py for the prefill side), the plan both ends derive alike (plan.py), the
connectors that say how pieces are cut and moved (connector.py), the receiver and sender that move
one transfer's pieces (receiver.py, sender.py), and the drivers that do each side's I/O (fetch.py
on the decode side, ship.py on the prefill side). Bytes move on a transport of shared.dataplane;
control messages (shared.control) carry only descriptors.
"""
