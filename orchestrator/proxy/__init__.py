"""The edge proxy (fly-proxy): HTTP requests for `<app>.<domain>` routed to the app's machines.

Stateless, any number at once. The route table is local replicas of KV buckets (`routes`), so the hot
path never asks a broker; the choice of machine is one pure function (`choose`); HTTP/1.1 framing is in
`http`, upstream connections in `upstream`; starting or creating a machine inside a request is `wake`,
stopping idle ones `idle`. `server` is the connection handler: `pick` chooses and wakes a machine for a
request (`ahead`: a suspended one resumed with the request on its way), `forward` sends it and relays the
answer, `failover` avoids and reports a machine that failed. See docs/tutorials/edge.md.
"""
