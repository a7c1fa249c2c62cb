// The demo page in real headless Chromium, against the real `shop`: what
// the page says, its legend, and that its timeline shows every attempt the
// browser really sent, with the answer it really got, and adds up to the
// shop's counts.
const { test, before, after } = require("node:test");
const assert = require("node:assert");
const { spawn } = require("node:child_process");
const fs = require("node:fs");
const os = require("node:os");
const path = require("node:path");
const { chromium } = require("playwright-core");

const SHOP = process.env.SHOP_BIN || path.join(__dirname, "..", "..", "target", "debug", "shop");
const OUT = process.env.TEST_OUTPUT_DIR || path.join(__dirname, "output");
const SIDES = ["with", "without"];

function startShop(dir) {
  return new Promise((resolve, reject) => {
    const child = spawn(SHOP, ["--listen", "127.0.0.1:0", "--database-url", `sqlite:${path.join(dir, "shop.db")}`], {
      env: { ...process.env, SHOP_LOG: "warn" },
      stdio: ["ignore", "pipe", "inherit"],
    });
    const timer = setTimeout(() => reject(new Error("shop did not start")), 30000);
    child.stdout.on("data", (d) => {
      const m = /shop listening on (\S+)/.exec(String(d));
      if (m) {
        clearTimeout(timer);
        resolve({ child, base: m[1] });
      }
    });
    child.on("error", reject);
    child.on("exit", (code) => reject(new Error(`shop exited with ${code}`)));
  });
}

let shop;
let browser;
before(async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "idem-browser-"));
  shop = await startShop(dir);
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
});
after(async () => {
  if (browser) await browser.close();
  if (shop) shop.child.kill();
});

// What the browser itself sent and got back, per side, whatever the page
// says: a request to POST /payments is the keyed side's, one to
// POST /bare/payments the naive side's.
function watchNetwork(page) {
  const sent = { with: [], without: [] };
  const byRequest = new Map();
  page.on("request", (req) => {
    if (req.method() !== "POST") return;
    const p = new URL(req.url()).pathname;
    const side = p === "/payments" ? "with" : p === "/bare/payments" ? "without" : null;
    if (!side) return;
    const entry = { key: req.headers()["idempotency-key"] || "", answer: "pending" };
    sent[side].push(entry);
    byRequest.set(req, entry);
  });
  page.on("response", (res) => {
    const entry = byRequest.get(res.request());
    if (!entry) return;
    const replayed = res.headers()["idempotent-replayed"] === "true";
    entry.answer = res.status() === 201 ? (replayed ? "201-replayed" : "201") : String(res.status());
  });
  page.on("requestfailed", (req) => {
    const entry = byRequest.get(req);
    if (entry) entry.answer = "no-reply";
  });
  return sent;
}

async function openPage(width = 1100) {
  const page = await browser.newPage({ viewport: { width, height: 800 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  const sent = watchNetwork(page);
  await page.goto(shop.base + "/");
  return { page, sent, errors };
}

// Every attempt row of a side's timeline, oldest first.
async function timeline(page, side) {
  const rows = await page.$$eval(`#${side}-timeline .attempt`, (lis) => lis.map((li) => ({
    n: Number(li.dataset.n),
    intent: li.closest(".intent").dataset.intent,
    answer: li.dataset.answer,
    replayed: li.dataset.replayed,
    charged: li.dataset.charged,
    paid: li.dataset.paid,
    chargeId: li.dataset.chargeId || "",
    paymentId: li.dataset.paymentId || "",
    key: li.querySelector(".key").title,
    keyText: li.querySelector(".key").textContent,
    chip: li.querySelector(".chip").textContent,
    text: li.textContent,
  })));
  return rows.sort((a, b) => a.n - b.n);
}

async function counts(page, side) {
  const read = async (f) => Number(await page.locator(`#${side}-${f}`).textContent());
  return { payments: await read("payments"), charges: await read("charges") };
}

// Waits until every attempt is answered and accounted for, and the page's
// tally of its timeline equals the shop's counts; then checks they stay so.
async function settle(page) {
  const settled = () => ["with", "without"].every((s) => {
    const tally = document.querySelector(`#${s}-tally`);
    return tally.dataset.matches === "true"
      && !document.querySelector(`#${s}-timeline .attempt[data-charged="unknown"]`)
      && !document.querySelector(`#${s}-timeline .attempt[data-answer="pending"]`);
  }) && !document.querySelector("#reset").disabled;
  await page.waitForFunction(settled, null, { timeout: 45000 });
  await page.waitForTimeout(1500);
  assert.ok(await page.evaluate(settled), "the timeline and the counts stay settled");
}

// The timeline has one row per request the browser sent, with the answer the
// browser got (same multiset per side), and the key it sent.
async function assertTimelineIsTheNetwork(page, sent) {
  for (const side of SIDES) {
    const rows = await timeline(page, side);
    const onWire = sent[side];
    assert.strictEqual(rows.length, onWire.length, `${side}: one timeline row per request sent`);
    const answers = (list) => list.map((x) => x.answer).sort();
    assert.deepStrictEqual(answers(rows), answers(onWire), `${side}: the answers shown are the answers got`);
    assert.deepStrictEqual(rows.map((r) => r.key).sort(), onWire.map((x) => x.key).sort(), `${side}: the keys shown are the keys sent`);
    for (const r of rows) {
      const chip = {
        "201": /^✓ ?201 Created$/, "201-replayed": /201 replayed/, "409": /409/, "no-reply": /no reply/,
      }[r.answer] || new RegExp(r.answer);
      assert.match(r.chip, chip, `${side} #${r.n}: the answer is written out`);
      if (r.answer === "201-replayed") assert.match(r.text, /Idempotent-Replayed: true/);
      if (side === "without") assert.strictEqual(r.keyText, "no key");
    }
  }
}

// The counts are what the timeline's rows say they did, and what the raw
// answers imply: with a key, one payment and one charge per distinct id
// answered; without, one of each per 201, and a charge per lost reply (the
// bank is slower than the page's patience, so it charged before the page
// hung up).
async function assertCountsMatchTimeline(page) {
  for (const side of SIDES) {
    const rows = await timeline(page, side);
    const c = await counts(page, side);
    const marked = (f) => rows.filter((r) => r[f] === "yes").length;
    assert.strictEqual(c.payments, marked("paid"), `${side}: Payments = rows marked +1 payment`);
    assert.strictEqual(c.charges, marked("charged"), `${side}: Bank charges = rows marked +1 charge`);
    const tally = page.locator(`#${side}-tally`);
    assert.strictEqual(Number(await tally.getAttribute("data-payments")), c.payments);
    assert.strictEqual(Number(await tally.getAttribute("data-charges")), c.charges);
    if (side === "with") {
      const distinct = (f) => new Set(rows.filter((r) => r.answer.startsWith("201")).map((r) => r[f])).size;
      assert.strictEqual(c.payments, distinct("paymentId"), "with: one payment per distinct payment answered");
      assert.strictEqual(c.charges, distinct("chargeId"), "with: one charge per distinct charge answered");
    } else {
      const n = (a) => rows.filter((r) => r.answer === a).length;
      assert.strictEqual(c.payments, n("201"), "without: one payment per 201");
      assert.strictEqual(c.charges, n("201") + n("no-reply"), "without: one charge per 201 and per lost reply");
    }
  }
}

// No attempt number is cut off, whatever its width, and nothing sticks out.
async function assertNothingClipped(page) {
  const report = await page.evaluate(() => {
    const bad = [];
    for (const num of document.querySelectorAll(".timeline .num")) {
      const r = num.getBoundingClientRect();
      const box = num.closest(".timeline").getBoundingClientRect();
      if (num.clientWidth === 0 || num.scrollWidth > num.clientWidth || r.left < box.left - 0.5 || r.right > box.right + 0.5) {
        bad.push(num.textContent);
      }
    }
    for (const e of document.querySelectorAll(".timeline, .timeline .attempt")) {
      if (e.scrollWidth > e.clientWidth) bad.push(e.className + ": " + e.textContent.slice(0, 40));
    }
    const nums = [...document.querySelectorAll(".timeline .num")].map((n) => n.textContent.replace(/\D/g, ""));
    const doc = document.documentElement;
    return { bad, nums, pageOverflow: doc.scrollWidth > doc.clientWidth };
  });
  assert.deepStrictEqual(report.bad, [], "clipped or overflowing");
  assert.ok(report.nums.some((n) => Number(n) >= 10), "there are numbers from 10 up to check");
  assert.strictEqual(report.pageOverflow, false, "the page does not scroll sideways");
}

test("the page says what each button sends, and has a legend", { timeout: 60000 }, async () => {
  const { page, errors } = await openPage();
  try {
    const lead = (await page.locator("#lead").textContent()).replace(/\s+/g, " ");
    assert.doesNotMatch(lead, /twice over/, "the old, untrue lead is gone");
    assert.match(lead, /one payment and sends it to both columns/);
    const said = async (id) => (await page.locator(id).textContent()).replace(/\s+/g, " ");
    assert.match(await said("#d-pay"), /Pay sends it once/);
    assert.match(await said("#d-double"), /Double-click sends it twice/);
    assert.match(await said("#d-lost"), /gives up waiting after 0\.5 s, then retries/);
    assert.match(await said("#d-storm"), /Retry storm sends it 10 times at once/);
    await page.locator("#storm").fill("12");
    assert.match(await said("#d-storm"), /sends it 12 times at once/, "the storm size is the one set");
    // each button is described by its line
    assert.strictEqual(await page.getByRole("button", { name: "Pay" }).getAttribute("aria-describedby"), "d-pay");

    const legend = page.getByRole("region", { name: "How to read the columns" });
    assert.ok(await legend.isVisible(), "the legend is shown");
    const text = (await legend.textContent()).replace(/\s+/g, " ");
    for (const needle of ["Payments", "Charged", "Bank charges", "more than Payments", "201 Created",
      "201 replayed", "Idempotent-Replayed: true", "409", "Retry-After", "422", "502", "no reply",
      "+1 payment, +1 charge", "+1 charge, no payment", "no new charge",
      "Why the counts differ without a key", "the naive shop is cut off before it records the payment"]) {
      assert.ok(text.includes(needle), `the legend explains ${needle}`);
    }
    // each answer's colour comes with its words and a symbol, not alone
    for (const chip of await legend.locator(".chip").all()) {
      assert.match(await chip.textContent(), /\d{3}|no reply/);
    }
    assert.deepStrictEqual(errors, []);
  } finally {
    await page.close();
  }
});

test("reply lost: two charges without a key, one with, and the timeline shows why", { timeout: 120000 }, async () => {
  const { page, sent, errors } = await openPage();
  try {
    await page.getByRole("button", { name: "Reply lost, retry" }).click();
    await settle(page);
    assert.deepStrictEqual(await counts(page, "with"), { payments: 1, charges: 1 }, "one payment, one charge with a key");
    assert.deepStrictEqual(await counts(page, "without"), { payments: 1, charges: 2 }, "one payment, two charges without");
    await assertTimelineIsTheNetwork(page, sent);
    await assertCountsMatchTimeline(page);

    const withKey = await timeline(page, "with");
    assert.strictEqual(withKey[0].answer, "no-reply", "with: the first try's reply is lost");
    assert.strictEqual(withKey.at(-1).answer, "201-replayed", "with: the retries end on the first answer, replayed");
    assert.strictEqual(withKey.at(-1).replayed, "true");
    for (const r of withKey.slice(1, -1)) assert.strictEqual(r.answer, "409", "with: meanwhile, 409 in flight");
    assert.strictEqual(new Set(withKey.map((r) => r.key)).size, 1, "with: one key for every attempt");
    assert.match(withKey[0].key, /^[!-~]{1,255}$/);
    assert.deepStrictEqual(withKey.map((r) => r.charged), ["yes", ...withKey.slice(1).map(() => "no")],
      "with: the first try charged (the shop finished it), no retry did");
    assert.match(withKey[0].text, /shop finished it anyway/);

    const naive = await timeline(page, "without");
    assert.deepStrictEqual(naive.map((r) => r.answer), ["no-reply", "201"], "without: lost, then a new payment");
    assert.deepStrictEqual(naive.map((r) => [r.charged, r.paid]), [["yes", "no"], ["yes", "yes"]],
      "without: the lost try charged with no payment, the retry charged again");
    assert.match(naive[0].text, /\+1 charge, no payment/);
    const why = (await page.locator("#without-why").textContent()).replace(/\s+/g, " ");
    assert.match(why, /Bank charges is 1 more than Payments/, "the naive column says why its counts differ");
    assert.match(await page.locator("#without-charges").getAttribute("class"), /\bover\b/);
    assert.match(await page.locator("#without-tally").textContent(), /the same as the counts above/);
    const intentSum = await page.locator("#without-timeline .intent-sum").textContent();
    assert.match(intentSum, /1 payment, 2 charges/);
    assert.deepStrictEqual(errors, []);
    fs.mkdirSync(OUT, { recursive: true });
    await page.screenshot({ path: path.join(OUT, "reply-lost.png"), fullPage: true });
  } finally {
    await page.close();
  }
});

test("a storm of 12, a double click and a payment: every attempt in the timeline, numbers from 10 up whole", { timeout: 120000 }, async () => {
  const { page, sent, errors } = await openPage();
  try {
    await page.locator("#storm").fill("12");
    await page.getByRole("button", { name: "Retry storm" }).click();
    await settle(page);
    assert.deepStrictEqual(await counts(page, "with"), { payments: 1, charges: 1 }, "a storm with one key: one payment");
    assert.deepStrictEqual(await counts(page, "without"), { payments: 12, charges: 12 }, "a storm without a key: twelve");
    const withKey = await timeline(page, "with");
    assert.strictEqual(withKey.length, 12);
    assert.strictEqual(withKey.filter((r) => r.answer === "201").length, 1, "with: one attempt ran");
    for (const r of withKey) assert.ok(["201", "409", "201-replayed"].includes(r.answer), `with #${r.n}: ${r.answer}`);
    assert.deepStrictEqual((await timeline(page, "without")).map((r) => r.answer), Array(12).fill("201"));
    await assertTimelineIsTheNetwork(page, sent);
    await assertCountsMatchTimeline(page);
    await assertNothingClipped(page);

    await page.getByRole("button", { name: "Double-click" }).click();
    await settle(page);
    await page.getByRole("button", { name: "Pay" }).click();
    await settle(page);
    assert.deepStrictEqual(await counts(page, "with"), { payments: 3, charges: 3 });
    assert.deepStrictEqual(await counts(page, "without"), { payments: 15, charges: 15 });
    await assertTimelineIsTheNetwork(page, sent);
    await assertCountsMatchTimeline(page);
    // newest first: the payment, the double click, the storm
    const heads = await page.locator("#with-timeline > .intent .intent-head strong").allTextContents();
    assert.deepStrictEqual(heads, ["3. Pay", "2. Double-click", "1. Retry storm"]);
    const sums = await page.locator("#with-timeline .intent-sum").allTextContents();
    assert.deepStrictEqual(sums.map((s) => s.replace(/\s+/g, " ")), Array(3).fill("→ 1 payment, 1 charge"));
    assert.deepStrictEqual(errors, []);
    fs.mkdirSync(OUT, { recursive: true });
    await page.screenshot({ path: path.join(OUT, "storm.png"), fullPage: true });

    // phone width: everything still there, nothing cut off
    await page.setViewportSize({ width: 390, height: 844 });
    assert.ok(await page.getByRole("button", { name: "Retry storm" }).isVisible());
    await assertNothingClipped(page);
    await page.screenshot({ path: path.join(OUT, "phone.png"), fullPage: true });
  } finally {
    await page.close();
  }
});
