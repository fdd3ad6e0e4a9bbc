"""The bus: everything fauxmad's processes say to each other over NATS.

Workers and the orchestrator never import each other; they meet here. This package owns the subject
names (`subjects`), the message types and their one decoder each (`messages`, `codec`), the error
contract (`errors`, `service`), and the plumbing every process needs (`connection`, `scatter`,
`embedded`, `jetstream`, and `jsfast` for JetStream requests made per job). It imports neither `workers`
nor `orchestrator`, nor any CLI library.
"""

from bus import lazy_aiohttp

lazy_aiohttp.defer()
