// express-idempotency with its default (in-memory) data adapter, as its
// README describes: the middleware, then isHit() in the handler.
const express = require("express");
const idempotency = require("express-idempotency");
const { work, listen } = require("./common");

const app = express();
app.use(express.json());
app.post("/payments", idempotency.idempotency(), async (req, res) => {
  const service = idempotency.getSharedIdempotencyService();
  if (service.isHit(req)) {
    return;
  }
  const body = await work(req);
  res.status(201).json(body);
});
listen(app, Number(process.env.PORT || 18092), "express-idempotency");
