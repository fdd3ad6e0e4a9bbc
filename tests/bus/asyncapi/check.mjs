// Parses an AsyncAPI document with the reference parser (@asyncapi/parser) and prints what it found.
// Exit 0 when the document parses with no error diagnostic; 1 otherwise (each error on its own line).
import { Parser } from '@asyncapi/parser';
import { readFileSync } from 'node:fs';

const ERROR = 0;
const parser = new Parser();
const { document, diagnostics } = await parser.parse(readFileSync(process.argv[2], 'utf8'));
const errors = diagnostics.filter((d) => d.severity === ERROR);
for (const d of errors) console.log(`error ${d.code}: ${d.message} at ${JSON.stringify(d.path)}`);
if (document) {
  console.log(JSON.stringify({
    channels: document.allChannels().length,
    operations: document.allOperations().length,
    messages: document.allMessages().length,
    addresses: document.allChannels().all().map((c) => c.address()),
  }));
}
process.exit(errors.length || !document ? 1 : 0);
