// @node-idempotency/core with its Redis storage adapter, wired into an
// express route as its README describes (onRequest before, onResponse after).
const express = require("express");
const { Idempotency } = require("@node-idempotency/core");
const { RedisStorageAdapter } = require("@node-idempotency/storage-adapter-redis");
const { work, listen } = require("./common");

async function main() {
  const storage = new RedisStorageAdapter({ connection: { url: process.env.REDIS_URL || "redis://127.0.0.1:6379" } });
  await storage.connect();
  const idempotency = new Idempotency(storage, { enforceIdempotency: true });
  const app = express();
  app.use(express.json());
  app.post("/payments", async (req, res) => {
    const request = { method: req.method, headers: req.headers, body: req.body, path: req.path };
    try {
      const cached = await idempotency.onRequest(request);
      if (cached) {
        res.set("idempotent-replayed", "true");
        return res.status(cached.additional?.status || 200).json(cached.body);
      }
    } catch (err) {
      const code = err.code === "REQUEST_IN_PROGRESS" ? 409 : err.code === "IDEMPOTENCY_FINGERPRINT_MISSMATCH" ? 422 : 400;
      return res.status(code).json({ error: err.code || String(err) });
    }
    const body = await work(req);
    await idempotency.onResponse(request, { body, additional: { status: 201 } });
    res.status(201).json(body);
  });
  listen(app, Number(process.env.PORT || 18091), "node-idempotency");
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
