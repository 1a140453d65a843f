import { Server, launchBrowser, openPage } from "/work/main/e2e/support.mjs";
const browser = await launchBrowser();
const server = await Server.start();
try {
  const s = await server.post("/v1/sessions", { agent: "overseer" });
  const { run_id } = await server.post(`/v1/sessions/${s.id}/messages`, { content: "Have it written" });
  await new Promise((r) => setTimeout(r, 1500));
  const pending = await server.get(`/v1/approvals`);
  console.log(JSON.stringify(pending).slice(0, 300));
  const a = pending.items[0];
  await server.post(`/v1/approvals/${a.id}`, { decisions: a.calls.map((c) => ({ call_id: c.call_id, verdict: "approve" })) }).catch((e) => console.log("decide", e.message));
  await new Promise((r) => setTimeout(r, 1500));
  const tree = await server.get(`/v1/runs/${run_id}/tree`);
  for (const n of tree.nodes) console.log(n.agent, JSON.stringify((await server.get(`/v1/runs/${n.run_id}/steps`)).items.map((s) => [s.index, s.instruction, s.started_at, s.finished_at, s.summary])));
  const page = await openPage(browser, server.url);
  await page.goto(`${server.url}/#/runs/${run_id}`);
  await new Promise((r) => setTimeout(r, 2000));
  console.log("errors", page.errors);
  console.log(await page.evaluate(() => document.querySelector(".waterfall").innerText));
} finally {
  await server.stop();
  await browser.close();
}
