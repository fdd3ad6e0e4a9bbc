"""The web console at `/ui` of `fauxmad api`: the fleet, an app, a machine, jobs and a heatmap, in a browser.

Served by the API's own listener with the API's tokens (`auth`); pages are rendered here as plain HTML with
inline SVG (`pages`, `charts`) from the data the CLI reads too (`data`: the systemwide view kept by one follower
in this process, the brokers, releases, jobs, logs), and kept live by server-sent events (`live`). Actions go
through the HTTP API's own handlers (`routes`), so their outcome is the API's. No front-end build step, no
library: a few hundred lines of vanilla JS (`static/console.js`).
"""
