// The Node sample for `fauxmad launch`: an HTTP app on $PORT (launch reads package.json's "main").
const http = require("http");

const server = http.createServer((req, res) => {
  const body = JSON.stringify({ sample: "node", machine: process.env.FAUXMAD_MACHINE_ID || null });
  res.writeHead(200, { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(body) });
  res.end(body);
});

server.listen(Number(process.env.PORT), "127.0.0.1", () => console.log(`listening on ${process.env.PORT}`));
process.on("SIGTERM", () => server.close(() => process.exit(0)));
