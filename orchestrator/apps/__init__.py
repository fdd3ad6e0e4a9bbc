"""The app model: what an app is (`spec`, its `fauxmad.toml`), its releases in KV (`releases`, over the release
`store`), who may run or add its machines (`ownership`) and its edge service (`http_service`).

The operator, the edge proxy, the HTTP API, the console, the jobs and the CLI all read an app through this
package, none of them through another's internals. It stands on the bus only.
"""
