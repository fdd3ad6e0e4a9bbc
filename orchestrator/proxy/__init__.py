"""The edge proxy (fly-proxy): HTTP requests for `<app>.<domain>` routed to the app's machines.

Stateless, any number at once. The route table is local replicas of KV buckets (`routes`), so the hot
path never asks a broker; the choice of machine is one pure function (`choose`); HTTP/1.1 framing is in
`http`, upstream connections in `upstream`; starting or creating a machine inside a request is `wake`,
stopping idle ones `idle`; `server` ties them to one connection handler. See README "The edge proxy".
"""
