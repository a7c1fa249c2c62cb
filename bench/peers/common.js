// The trivial endpoint every peer guards: sleeps for `x-simulate:
// bank-delay=MS` if asked (for in-flight collisions), then answers 201 with
// a fresh id.
const crypto = require("crypto");

function delayOf(req) {
  const m = /bank-delay=(\d+)/.exec(req.get("x-simulate") || "");
  return m ? Number(m[1]) : 0;
}

async function work(req) {
  const ms = delayOf(req);
  if (ms > 0) await new Promise((r) => setTimeout(r, ms));
  return { id: "pay_" + crypto.randomUUID(), status: "authorized" };
}

function listen(app, port, name) {
  app.listen(port, "127.0.0.1", () => console.log(`${name} listening on http://127.0.0.1:${port}`));
}

module.exports = { work, listen };
