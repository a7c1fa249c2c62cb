// The demo page in real headless Chromium: the "reply lost" scenario run
// with and without a key charges once and twice. Starts the real `shop`.
const { test } = require("node:test");
const assert = require("node:assert");
const { spawn } = require("node:child_process");
const fs = require("node:fs");
const os = require("node:os");
const path = require("node:path");
const { chromium } = require("playwright-core");

const SHOP = process.env.SHOP_BIN || path.join(__dirname, "..", "..", "target", "debug", "shop");
const OUT = process.env.TEST_OUTPUT_DIR || path.join(__dirname, "output");

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
  });
}

test("reply lost: two charges without a key, one with", { timeout: 120000 }, async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "idem-browser-"));
  const { child, base } = await startShop(dir);
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1100, height: 800 } });
    await page.goto(base + "/");
    await page.getByRole("button", { name: "Reply lost, retry" }).click();
    const charges = (side) => page.locator(`#${side}-charges`);
    // the keyed retry ends on the first attempt's answer, replayed; the
    // naive retry ends on a fresh payment of its own
    await page.waitForFunction(
      () => document.querySelector("#with-log li.replayed") && document.querySelector("#without-log li.fresh"),
      null,
      { timeout: 30000 },
    );
    // the counters poll the server: wait until they settle
    await page.waitForFunction(
      () => document.querySelector("#with-charges").textContent === "1"
        && document.querySelector("#without-charges").textContent === "2",
      null,
      { timeout: 10000 },
    );
    // and they stay there
    await page.waitForTimeout(1500);
    assert.strictEqual(await charges("with").textContent(), "1", "one charge with a key");
    assert.strictEqual(await charges("without").textContent(), "2", "two charges without");
    fs.mkdirSync(OUT, { recursive: true });
    await page.screenshot({ path: path.join(OUT, "reply-lost.png"), fullPage: true });
    // phone width: everything still there
    await page.setViewportSize({ width: 390, height: 844 });
    assert.ok(await page.getByRole("button", { name: "Retry storm" }).isVisible());
    await page.screenshot({ path: path.join(OUT, "phone.png"), fullPage: true });
  } finally {
    await browser.close();
    child.kill();
  }
});
