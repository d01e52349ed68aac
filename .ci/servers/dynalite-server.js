// dynalite, run so that a client's reset connection does not end it.
//
//     node dynalite-server.js MODULE_DIR HOST PORT
//
// MODULE_DIR is an installed dynalite package (.ci/servers/dynalite.sh installs 4.0.0 under
// /tmp). dynalite's own cli.js dies on the first connection a client resets mid-request: its
// request handler does `req.on('error', (err) => { throw err })`, so the ECONNRESET ("aborted")
// that Node emits on the request becomes an uncaught exception, and a test that kills a client
// (or a proxy that drops a connection) ends the server for every test after it. This launcher
// makes the same server through dynalite's module API and, for each request, hands dynalite a
// request whose 'error' listeners log and close that one exchange instead of throwing. Errors of
// a client's socket (a reset before a request was parsed) close that socket; an error of a
// closed connection that still escapes (ECONNRESET, EPIPE, a write to a destroyed stream) is
// logged. Anything else still ends the process, as it would have.
"use strict";

const path = require("path");

const [moduleDir, host, portText] = process.argv.slice(2);
if (!moduleDir || !host || !portText) {
    console.error("usage: node dynalite-server.js MODULE_DIR HOST PORT");
    process.exit(2);
}

const CONNECTION_GONE = new Set([
    "ECONNRESET",
    "EPIPE",
    "ECONNABORTED",
    "ERR_STREAM_DESTROYED",
    "ERR_STREAM_WRITE_AFTER_END",
]);

function gone(where, err) {
    console.error(`dynalite-server: ${where}: ${err && (err.code || err.message)} (ignored)`);
}

process.on("uncaughtException", (err) => {
    if (err && CONNECTION_GONE.has(err.code)) {
        gone("a closed connection", err);
        return;
    }
    console.error(err);
    process.exit(1);
});

const dynalite = require(path.resolve(moduleDir));
const server = dynalite({});

// dynalite's own handler, called with a request whose error listeners cannot throw.
const handlers = server.listeners("request");
server.removeAllListeners("request");
server.on("request", (req, res) => {
    const on = req.on;
    const guarded = function (event, listener) {
        if (event === "error") {
            return on.call(this, "error", (err) => {
                gone("a request", err);
                res.destroy();
            });
        }
        return on.call(this, event, listener);
    };
    req.on = guarded;
    req.addListener = guarded;
    res.on("error", (err) => gone("a response", err));
    for (const handler of handlers) handler.call(server, req, res);
});
server.on("clientError", (err, socket) => {
    gone("a client socket", err);
    socket.destroy();
});

server.listen(Number(portText), host, () => {
    const address = server.address();
    console.log(`Dynalite listening at: http://${address.address}:${address.port}`);
});
for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => process.exit(0));
