"""The contract: what fauxmad's processes say to each other, and nothing else.

Subjects and names (`subjects`); the message types per subject family (`base`: what every message stands
on; `machines`, `offers`, `fleet`, `volumes`, `jobs`, `edge`, `streams`) and each family's verbs (`verbs`);
the workers bucket's two kinds of key, a worker's and a process's beat group (`beats`),
machine ids (`ids`), the error contract (`errors`), the wire codec (`codec`) and the machine-readable contract
built from them (`schema`).
Every other package of fauxmad stands on it; it imports none of them, and nothing of NATS.
"""
