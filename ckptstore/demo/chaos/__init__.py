"""``ckptstore demo --chaos DURATION --fault-every SECONDS``: the demo's model trained unattended for a fixed
time under a seeded schedule of real faults, its goodput against a fault-free reference, and the same
schedule run with stock DCP beside it. See ``docs/DEMO.md``, "Chaos".

Modules: :mod:`.schedule` (the catalogue of fault kinds, the seeded schedule), :mod:`.worker` (the
unattended training loop, over ckptstore or stock DCP), :mod:`.clockexec` (a node's workers under
libfaketime), :mod:`.supervisor` (launches the nodes and does what a scheduler does), :mod:`.inject`
(each fault, made real), :mod:`.timeline` (what happened: steps kept, each fault's detection and
recovery, the comparison with the reference), :mod:`.report` (tables and the summary) and :mod:`.run`
(the whole run, phase by phase).
"""
