"""A live web dashboard of a job's folder: `rlplex dashboard OUT`.

The page (`static/`: HTML, one script, uPlot for the charts, all shipped in the package: the
machines it runs on have no internet) polls `/api/view` once a second and redraws without
reloading. The view is the one `rlplex status` and the live terminal view read (`collect()`),
so the dashboard shows what they show, plus the learning curves and the event log.

Modules: `auth` (the token on every request), `sources` (which folder kind, read how often),
`snapshot` (the view as JSON, curves sent incrementally), `app` (routes and actions),
`server` (uvicorn on a socket bound to loopback by default).
"""
