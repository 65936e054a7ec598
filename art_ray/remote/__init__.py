"""Training over HTTP for clients that don't run Ray: a Serve app with the backend's verbs as routes
(`server`), the `HTTPBackend` that calls them (`client`), and the JSON both speak (`protocol`)."""
